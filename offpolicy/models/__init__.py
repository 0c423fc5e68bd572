"""The model whose weights the run trains: HF `transformers` causal LMs built or loaded from config.

Modules: `build` (`build_model`, `from_pretrained`, seeded initial weights by name and expert row,
`hf_state`, dtypes and devices by name), `gguf_import` (a GGUF model file into an HF checkpoint
directory, `offpolicy import-gguf` and `model.gguf`), `imports` (transformers in a daemon without scikit-learn and
scipy), `fp8_run` (the run's `weights.fp8_block_size` resolved against the model's shapes). Nothing is imported here.

May import: config, weights (docs/architecture.md, "Dependency rule").
"""
