"""The SGLang rollout engine (`rollout.engine: sglang`), written against sglang 0.5.23.

Modules: `wire` (request and response shapes, errors), `servers` (SGLang HTTP servers: health, load balancing,
pause/update/continue), `local` (sglang.Engine in process), `sigquit` (the in-process engine's processes failing:
SGLang's SIGQUIT, ours), `owner` (the thread that starts that engine and lives as long as it), `proof` (each load
proven by SGLang's read-back, get_weights_by_name, and which proof a load gets), `fingerprint_proof` (or by the
fingerprint of every tensor, where SGLang has no read-back), `worker` (the custom weight loader that computes it
inside SGLang's TP workers), `engine` (the RolloutEngine). Nothing here imports SGLang until the in-process engine
is built. docs/sglang.md lists every SGLang field and endpoint used, with the source line it was checked against
(0.5.23, and 0.5.14 where the GPU machines' differs).
"""

from offpolicy.rollout.engines.sglang.engine import SGLangEngine

__all__ = ["SGLangEngine"]
