"""Transport benchmark: sample groups through the real hub path vs raw ZeroMQ moving the same bytes.

The hub path is the production one end to end: a sender process plays a rollout (Hello, WorkRequest,
one Lease of `--groups` prompts), then for each prompt builds a `SampleGroup`, `protocol.encode`s it
and sends it from a DEALER; the `Hub` (on uvloop, in this process) receives in batches
(`transport.receive`), `protocol.decode`s, runs `validation.check_group`, settles the lease, applies
the staleness gate, keeps the group (views on its frames) in the batcher and answers each batch with
an `Ack` of its groups' outcomes. The sender's clock runs from its first send until every group is
acknowledged.

The raw path moves the very same frames (encoded before the clock starts) from a DEALER to a plain
blocking ROUTER that only receives them, and answers once at the end; same sender clock. Both run
over ipc and tcp loopback, `--repeat` times alternately; the table shows medians and the ratio
hub / raw of response tokens per second, and the CPU ratio: the CPU seconds per group of both raw
processes over those of both hub-path processes (sender and receiver, all threads), which is what the
wall ratio tends to when the cores are busy with other work too, and moves far less with that load. Decode and validation costs per million response tokens
are timed in this process on encoded frames. `--profile FILE` writes a cProfile of the hub side.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import uuid

import numpy as np
import zmq
import zmq.asyncio

from offpolicy.bench.common import fmt, free_port, median
from offpolicy.wire import protocol

VOCAB = 151_936  # token ids are drawn below a Qwen-sized vocabulary


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--groups", type=int, default=2048, help="sample groups per timed run (a multiple of --batch)")
    p.add_argument("--batch", type=int, default=64, help="groups per training batch the learner side takes")
    p.add_argument("--n", type=int, default=8, help="responses per group")
    p.add_argument("--tokens", type=int, default=1024, help="tokens per response")
    p.add_argument("--transports", nargs="+", default=["ipc", "tcp"], choices=["ipc", "tcp"],
                   help="ZeroMQ transports measured: ipc (a Unix socket) and/or tcp (loopback)")
    p.add_argument("--repeat", type=int, default=3, help="timed runs per transport and path (median)")
    p.add_argument("--profile", help="write a cProfile of the hub side of the last hub run to this file")


def run(args: argparse.Namespace) -> dict:
    # the hub says goodbye to each sender after it left: expected here, not worth a warning per run
    logging.getLogger("offpolicy.transport").setLevel(logging.ERROR)
    if args.groups % args.batch or args.groups < args.batch:
        raise SystemExit(f"--groups {args.groups} must be a positive multiple of --batch {args.batch}")
    group_bytes = 8 * args.n * args.tokens + 232  # token ids and logprobs, a short prompt, the header
    rows = []
    for kind in args.transports:
        runs: dict[str, list[dict]] = {"raw": [], "hub": []}
        for i in range(args.repeat):
            runs["raw"].append(_timed(kind, "raw", args))
            runs["hub"].append(_timed(kind, "hub", args, profile=args.profile if i == args.repeat - 1 else None))
        tokens = args.groups * args.n * args.tokens
        row: dict = {"transport": kind}
        for path, rs in runs.items():
            sec = median([r["seconds"] for r in rs])
            row |= {f"{path}_seconds": [r["seconds"] for r in rs], f"{path}_tokens_per_s": tokens / sec,
                    f"{path}_groups_per_s": args.groups / sec,
                    f"{path}_gb_per_s": args.groups * group_bytes / sec / 1e9,
                    f"{path}_sender_cpu_us_per_group": median([r["sender_cpu"] for r in rs]) / args.groups * 1e6,
                    f"{path}_receiver_cpu_us_per_group": median([r["receiver_cpu"] for r in rs]) / args.groups * 1e6}
        row["ratio"] = row["hub_tokens_per_s"] / row["raw_tokens_per_s"]
        # CPU per group of both sides, raw / hub: what the wall ratio tends to on cores busy with other work
        row["cpu_ratio"] = (row["raw_sender_cpu_us_per_group"] + row["raw_receiver_cpu_us_per_group"]) / \
            (row["hub_sender_cpu_us_per_group"] + row["hub_receiver_cpu_us_per_group"])
        rows.append(row)
    return {"groups": args.groups, "n": args.n, "tokens_per_response": args.tokens,
            "group_bytes": group_bytes, "runs": rows, "costs": codec_costs(args.n, args.tokens)}


def table(result: dict) -> str:
    lines = [f"{result['groups']} groups x {result['n']} responses x {result['tokens_per_response']} tokens "
             f"({result['group_bytes'] / 1024:.0f} KiB per group); medians of the timed runs",
             "", "| transport | raw ZeroMQ tokens/s | hub path tokens/s | hub groups/s | ratio hub/raw "
             "| CPU us/group raw (send / recv) | CPU us/group hub (send / recv) | CPU ratio raw/hub |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["runs"]:
        lines.append(f"| {r['transport']} | {fmt(r['raw_tokens_per_s'])} ({r['raw_gb_per_s']:.2f} GB/s) | "
                     f"{fmt(r['hub_tokens_per_s'])} | {fmt(r['hub_groups_per_s'])} | {r['ratio']:.2f} | "
                     f"{r['raw_sender_cpu_us_per_group']:.0f} / {r['raw_receiver_cpu_us_per_group']:.0f} | "
                     f"{r['hub_sender_cpu_us_per_group']:.0f} / {r['hub_receiver_cpu_us_per_group']:.0f} | "
                     f"{r['cpu_ratio']:.2f} |")
    c = result["costs"]
    lines += ["", "| per million response tokens | seconds |", "| --- | --- |"]
    lines += [f"| {k.removesuffix('_s_per_mtok')} | {v:.4f} |" for k, v in c.items()]
    return "\n".join(lines)


def _endpoint(kind: str) -> str:
    ipc = f"ipc://{tempfile.gettempdir()}/offpolicy-bench-{uuid.uuid4().hex[:8]}.sock"
    return ipc if kind == "ipc" else f"tcp://127.0.0.1:{free_port()}"


def _timed(kind: str, path: str, args, profile: str | None = None) -> dict:
    """Seconds from the sender's first send to the hub's last Ack (or the raw receiver's reply), and the
    CPU seconds of the sender (its timed loop) and of the receiving process (all its threads)."""
    endpoint = _endpoint(kind)
    cmd = [sys.executable, "-c", "from offpolicy.bench.transport import sender_main; sender_main()",
           path, endpoint, str(args.groups), str(args.n), str(args.tokens)]
    sender = Sender(cmd)
    try:
        if path == "raw":
            return _raw_receiver(endpoint, args.groups, sender)
        return _hub_receiver(endpoint, args, sender, profile)
    finally:
        sender.stop()
        if endpoint.startswith("ipc://") and os.path.exists(endpoint[6:]):
            os.unlink(endpoint[6:])


class Sender:
    """The sender child process; `result()` waits for what it prints as JSON."""

    def __init__(self, cmd: list[str]):
        self.cmd, self.proc = cmd, None

    def start(self) -> None:
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, text=True)

    def result(self) -> dict:
        line = self.proc.stdout.readline()
        if self.proc.wait(600) != 0 or not line:
            raise RuntimeError(f"the sender failed with exit code {self.proc.returncode}")
        return json.loads(line)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _raw_receiver(endpoint: str, groups: int, sender: Sender) -> dict:
    zctx = zmq.Context()
    router = zctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(endpoint)
    sender.start()
    cpu = time.process_time()
    try:
        ident, _ = router.recv_multipart()  # connected: the clock starts on our answer
        router.send_multipart([ident, b"go"])
        for _ in range(groups):
            router.recv_multipart(copy=False)
        router.send_multipart([ident, b"done"])
        return {**sender.result(), "receiver_cpu": time.process_time() - cpu}
    finally:
        router.close(0)
        zctx.term()


def _hub_receiver(endpoint: str, args, sender: Sender, profile: str | None) -> dict:
    from offpolicy.config import load_config
    from offpolicy.data.datasets import load_dataset
    from offpolicy.data.tokenizer import load_tokenizer
    from offpolicy.hub.hub import Hub
    from offpolicy.plumbing.metrics import LearnerMetrics
    from offpolicy.wire import transport

    steps = args.groups // args.batch
    # staleness `steps`: the gate admits the whole run's prompts in one lease at version 0
    cfg = load_config(None, [f"rollout.n_samples={args.n}", f"rollout.max_new_tokens={args.tokens}",
                             f"learner.batch_groups={args.batch}", f"algo.max_staleness={steps}", "data.shuffle=false",
                             f"data.synthetic.num_prompts={args.groups}", "transport.lease_timeout_s=600",
                             "model.arch.model_type=llama"])
    prof = cProfile.Profile() if profile else None

    async def learner(hub: Hub) -> int:
        """Take batches as the learner does (their memory is freed and reused, as in a run)."""
        taken = 0
        for step in range(steps):
            taken += len(await hub.next_batch(step))
        return taken

    async def main() -> dict:
        hub = Hub(cfg, load_dataset(cfg.data), load_tokenizer(cfg.model.tokenizer), LearnerMetrics(), vocab_size=VOCAB)
        zctx = zmq.asyncio.Context()
        await hub.start(zctx, work=endpoint, announce=_endpoint("ipc" if endpoint.startswith("ipc") else "tcp"))
        await hub.announce(protocol.WeightAnnouncement(version=0, path="", total_bytes=0, publish_seconds=0.0, step=0))
        consumer = asyncio.create_task(learner(hub))
        sender.start()
        cpu = time.process_time()
        if prof:
            prof.enable()
        try:
            result = await asyncio.to_thread(sender.result)
            taken = await asyncio.wait_for(consumer, 60)
            result["receiver_cpu"] = time.process_time() - cpu
        finally:
            if prof:
                prof.disable()
            consumer.cancel()
            await hub.close("bench over")
            zctx.term()
        if taken != args.groups:
            raise RuntimeError(f"the learner side took {taken} of {args.groups} groups")
        return result

    result = transport.run(main)
    if prof:
        prof.dump_stats(profile)
    return result


def _arrays(n: int, tokens: int, k: int = 8) -> list[tuple[np.ndarray, np.ndarray]]:
    """`k` distinct (response tokens, logprobs) pairs, reused round robin (memory stays small)."""
    rng = np.random.default_rng(0)
    return [(rng.integers(0, VOCAB, n * tokens, dtype=np.int32),
             -rng.random(n * tokens, dtype=np.float32) * 10) for _ in range(k)]


def sender_main() -> None:
    """Child process: the rollout side of one timed run; prints {"seconds": ..., "sender_cpu": ...}."""
    path, endpoint, groups, n, tokens = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
    print(json.dumps(_send(path, endpoint, groups, n, tokens)), flush=True)


def _send(path: str, endpoint: str, groups: int, n: int, tokens: int) -> dict:
    zctx = zmq.Context()
    s = zctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    data = _arrays(n, tokens)
    lengths, rewards, reasons = [tokens] * n, [0.5] * n, ["length"] * n
    try:
        if path == "raw":
            prompt = np.arange(1, 6, dtype=np.int32)
            msg = protocol.SampleGroup(lease_id=1, prompt_id=0, epoch=0, weight_version=0, response_lengths=lengths,
                                       rewards=rewards, finish_reasons=reasons)
            encoded = [[bytes(f) for f in protocol.encode(msg, prompt, *d)] for d in data]
            s.send(b"ready")
            s.recv()
            t0, cpu = time.perf_counter(), time.process_time()
            for i in range(groups):
                s.send_multipart(encoded[i % len(encoded)], copy=False)
            s.recv()
            return {"seconds": time.perf_counter() - t0, "sender_cpu": time.process_time() - cpu}
        s.send_multipart(protocol.encode(protocol.Hello(daemon_id="bench-sender", engine="none", max_groups=groups)))
        _expect(s, protocol.Welcome)
        s.send_multipart(protocol.encode(protocol.WorkRequest(credits=groups)))
        lease, (ptoks,) = _expect(s, protocol.Lease)
        cuts = np.cumsum([p.n_tokens for p in lease.prompts])[:-1]
        prompts = np.split(ptoks.copy(), cuts)
        acks = 0
        t0, cpu = time.perf_counter(), time.process_time()
        for i, p in enumerate(lease.prompts):
            msg = protocol.SampleGroup(lease_id=lease.lease_id, prompt_id=p.prompt_id, epoch=p.epoch,
                                       weight_version=0, response_lengths=lengths, rewards=rewards,
                                       finish_reasons=reasons)
            s.send_multipart(protocol.encode(msg, prompts[i], *data[i % len(data)]), copy=False)
            while s.poll(0):
                acks += len(_expect(s, protocol.Ack)[0].groups)
        while acks < groups:
            acks += len(_expect(s, protocol.Ack)[0].groups)
        return {"seconds": time.perf_counter() - t0, "sender_cpu": time.process_time() - cpu}
    finally:
        s.close(0)
        zctx.term()


def _expect(s, kind):
    """The next message, which must be a `kind` (an Ack must accept every group it answers)."""
    msg, arrays = protocol.decode(s.recv_multipart())
    if not isinstance(msg, kind) or (isinstance(msg, protocol.Ack) and not all(g.accepted for g in msg.groups)):
        raise RuntimeError(f"expected {kind.__name__}, got {msg}")
    return msg, arrays


def codec_costs(n: int, tokens: int, reps: int = 200) -> dict:
    """Seconds per million response tokens of encode, decode and check_group, in this process."""
    from offpolicy.hub.validation import check_group

    resp, logp = _arrays(n, tokens, k=1)[0]
    prompt = np.arange(1, 6, dtype=np.int32)
    msg = protocol.SampleGroup(lease_id=1, prompt_id=0, epoch=0, weight_version=0, response_lengths=[tokens] * n,
                               rewards=[0.5] * n, finish_reasons=["length"] * n)
    frames = [bytes(f) for f in protocol.encode(msg, prompt, resp, logp)]
    decoded, arrays = protocol.decode(frames)

    def per_mtok(fn) -> float:
        fn()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps / (n * tokens) * 1e6

    return {"encode_s_per_mtok": per_mtok(lambda: protocol.encode(msg, prompt, resp, logp)),
            "decode_s_per_mtok": per_mtok(lambda: protocol.decode(frames)),
            "check_group_s_per_mtok": per_mtok(lambda: check_group(decoded, arrays, n_samples=n, max_new_tokens=tokens,
                                                                   vocab_size=VOCAB, min_version=0, newest_version=0))}
