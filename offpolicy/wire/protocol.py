"""Wire protocol: every message between daemons, as tagged msgspec Structs, plus array frames.

A message on the wire is one multipart ZeroMQ message: frame 0 is the msgpack-encoded header (a
tagged Struct below, with `proto` = PROTOCOL_VERSION), frames 1.. are raw little-endian arrays
whose count, dtype and length the header fixes. Token ids and logprobs travel only in those array
frames, never as Python lists, never pickled. `decode` is typed: a header that does not decode, a
wrong protocol version, or array frames that disagree with the header raise `ProtocolError`, which
daemons count and log before they go on.

Flows (rollout = DEALER, hub = ROUTER; announcements on PUB/SUB):
  rollout -> hub: Hello, WorkRequest, SampleGroup, Heartbeat, VersionQuery
  hub -> rollout: Welcome, Lease, Ack (outcomes of one or more groups), Error, Goodbye,
                  WeightAnnouncement (to a VersionQuery)
  hub PUB -> SUB: WeightAnnouncement, Goodbye
  relay DEALER -> upstream ROUTER (offpolicy/relay): RelayQuery, ChunkRequest
  upstream -> relay: RelayOffer, Chunk (frame 1: raw bytes; its CRC-32 in the header), RelayMissing, Error
"""

from __future__ import annotations

from typing import Annotated, Union

import msgspec
import numpy as np

PROTOCOL_VERSION = 3  # 2: one Ack answers several groups (`Ack.groups`); 3: `Chunk.crc32`
TOKEN_DTYPE = np.dtype("<i4")
LOGPROB_DTYPE = np.dtype("<f4")
BYTE_DTYPE = np.dtype("u1")


class ProtocolError(ValueError):
    """A frame set that is not a valid message of this protocol version."""


class ProtocolVersionError(ProtocolError):
    """A message of another protocol version (daemons answer it with `Error(protocol_version)`)."""


class _Msg(msgspec.Struct, tag_field="type", forbid_unknown_fields=True, kw_only=True):
    proto: int = PROTOCOL_VERSION


class Hello(_Msg, tag="hello"):
    # unique per daemon process, e.g. "rollout-0@node12:4242"; out-of-range fields fail to decode (rejected, counted)
    daemon_id: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    engine: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]  # engine kind, e.g. "torch"
    max_groups: Annotated[int, msgspec.Meta(ge=1)]  # groups it can generate at once (its credit ceiling)
    # the daemon's place in the run, the same across its restarts ("rollout-0@node12"); "" = none. A Hello under
    # a slot that another daemon holds says that one is gone: the hub gives its leased prompts to others at once
    slot: Annotated[str, msgspec.Meta(max_length=256)] = ""


class Welcome(_Msg, tag="welcome"):
    run: str
    newest_version: int  # newest published weight version (-1 = none yet)
    n_samples: int  # responses per prompt the hub expects in each group
    max_new_tokens: int
    incarnation: int = 0  # random per learner process: a new value means the learner restarted


class WorkRequest(_Msg, tag="work"):
    credits: int  # how many prompt groups the rollout can take now


class LeasePrompt(msgspec.Struct, forbid_unknown_fields=True):
    prompt_id: int  # index of the prompt in the data set
    epoch: int
    n_tokens: int  # this prompt's length in the lease's token frame
    text: str = ""  # prompt text, handed to the reward function
    answer: str = ""  # reference answer handed to the reward function
    data_source: str = ""  # the prompt's data_source (verl rows, reasoning-gym): picks its reward (data.reward_by_source)


class Lease(_Msg, tag="lease"):
    """A grant of prompts; frame 1 holds all prompts' token ids, concatenated."""

    lease_id: int
    min_version: int  # generate with this weight version or newer
    deadline_s: float  # seconds from now until the lease is given to another rollout
    prompts: list[LeasePrompt]


class VersionRun(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """Tokens `start ..` of a response (up to the next run's start) were produced by weight version `version`
    (a msgpack pair on the wire). `offpolicy.wire.versions` builds, expands and checks runs."""

    start: int  # index of the first response token this version produced
    version: int


class SampleGroup(_Msg, tag="group"):
    """n responses to one prompt. Frames: 1 prompt tokens, 2 response tokens, 3 behaviour logprobs.

    Per-token versions (`rollout.inflight_updates`: a generation moved to a newer version between decode steps):
    `version_runs` holds one run list per response, each starting at token 0, starts and versions strictly
    increasing; `weight_version` is then the oldest version any token of the group used (the staleness the
    hub checks). Empty (the default, and what a message from before the field decodes as): every token of
    every response was produced by `weight_version`: then the field is `UNSET` and left out of the message, so a hub
    from before `version_runs` still takes the groups of a rollout that switched no version in flight (`runs_of`
    reads it as a list either way)."""

    lease_id: int
    prompt_id: int
    epoch: int
    weight_version: int  # oldest version any token of the group was generated with (with no version_runs: every token's)
    response_lengths: list[int]  # tokens per response; frames 2 and 3 hold their concatenation
    rewards: list[float]
    finish_reasons: list[str]  # "stop" or "length" per response
    gen_seconds: float = 0.0  # wall time this group's batch took to generate
    # per response, the version of each token run-length coded (class doc); UNSET (left out) = every token weight_version's
    version_runs: list[list[VersionRun]] | msgspec.UnsetType = msgspec.UNSET

    @property
    def runs_of(self) -> list[list[VersionRun]]:
        """`version_runs` as a list ([] when left out)."""
        return self.version_runs or []


class GroupOutcome(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """What the hub did with one returned group (a msgpack array on the wire, not a map)."""

    lease_id: int
    prompt_id: int
    accepted: bool
    reason: str = ""  # why a group was not accepted ("duplicate", "stale", "unknown lease", ...)


class Ack(_Msg, tag="ack"):
    """The outcomes of one or more groups from one rollout, in the order they arrived: the hub answers
    all the groups it took from a peer in one receive batch (what was ready at once) with one Ack."""

    groups: list[GroupOutcome]


class Heartbeat(_Msg, tag="heartbeat"):
    daemon_id: str
    weight_version: int  # version the engine holds
    busy_groups: int  # groups being generated


class VersionQuery(_Msg, tag="version?"):
    pass


class WeightAnnouncement(_Msg, tag="weights"):
    version: int
    path: str  # version directory in the store (on the learner's node)
    total_bytes: int
    publish_seconds: float
    step: int  # optimizer steps behind this version (== version)


class Goodbye(_Msg, tag="goodbye"):
    reason: str  # the run is over; rollouts exit cleanly


class Error(_Msg, tag="error"):
    code: str  # "bad_message", "protocol_version", "not_welcome", ...
    message: str


class RelayQuery(_Msg, tag="relay?"):
    """Which version can you give me? Parked up to `wait_s` when there is none yet (a long poll)."""

    want: int  # the lowest version the asker still needs
    latest: bool = False  # offer the newest version >= want instead of the lowest
    wait_s: float = 0.0  # park the query this long at most when no such version exists yet
    format: str = "native"  # weight format (weights/formats.py): each format's versions are relayed on their own


class RelayOffer(_Msg, tag="relay-offer"):
    version: int  # the offered version; -1 = none (yet)
    newest: int  # newest version the answering node has heard of (-1 = none)
    ended: bool = False  # the run is over and the answering node holds everything it ever will
    manifest: bytes = b""  # the offered version's manifest.json, byte for byte


class ChunkRequest(_Msg, tag="chunk?"):
    version: int
    file: str  # a file name of the version's manifest
    offset: int
    length: int
    format: str = "native"  # weight format of the version (as in RelayQuery)


class Chunk(_Msg, tag="chunk"):
    """Bytes `offset .. offset + length` of one file of a version; frame 1 holds them, raw."""

    version: int
    file: str
    offset: int
    length: int
    # CRC-32 (zlib) of the bytes as the source read them from the learner's store, passed on unchanged by
    # every relay; None for a file whose manifest entry has a sha256 (that is checked over the whole file)
    crc32: int | None = None


class RelayMissing(_Msg, tag="relay-missing"):
    version: int  # a version the answering node does not have (any more): collected or refused
    reason: str


Message = Union[
    Hello, Welcome, WorkRequest, Lease, SampleGroup, Ack, Heartbeat, VersionQuery,
    WeightAnnouncement, Goodbye, Error, RelayQuery, RelayOffer, ChunkRequest, Chunk, RelayMissing,
]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


_FRAME_DTYPES: dict[type, tuple[np.dtype, ...]] = {
    Lease: (TOKEN_DTYPE,), SampleGroup: (TOKEN_DTYPE, TOKEN_DTYPE, LOGPROB_DTYPE), Chunk: (BYTE_DTYPE,),
}


def encode(msg: Message, *arrays: np.ndarray) -> list[bytes | memoryview]:
    """Header frame plus raw little-endian array frames, ready for send_multipart(copy=False).

    Arrays are converted to the wire dtype of their frame (int64 token ids become int32, say); an
    array of another kind (floats for token ids) raises TypeError rather than travel as garbage.
    """
    dtypes = _FRAME_DTYPES.get(type(msg), ())
    if len(arrays) != len(dtypes):
        raise TypeError(f"{type(msg).__name__} takes {len(dtypes)} array frames, got {len(arrays)}")
    frames: list[bytes | memoryview] = [_encoder.encode(msg)]
    for a, dtype in zip(arrays, dtypes):
        a = np.asarray(a)
        if not np.can_cast(a.dtype, dtype, "same_kind"):
            raise TypeError(f"{type(msg).__name__}: a {a.dtype} array cannot travel as {dtype}")
        frames.append(memoryview(np.ascontiguousarray(a, dtype=dtype)).cast("B"))
    return frames


def decode(frames: list) -> tuple[Message, list[np.ndarray]]:
    """Typed decode of a frame list; raises ProtocolError on anything that is not a valid message."""
    if not frames:
        raise ProtocolError("empty message")
    try:
        msg = _decoder.decode(frames[0])
    except (msgspec.MsgspecError, UnicodeDecodeError) as e:  # msgspec lets invalid UTF-8 in keys through
        if isinstance(e, msgspec.ValidationError) and _wrong_proto(frames[0]):
            raise ProtocolVersionError(f"protocol version mismatch: expected {PROTOCOL_VERSION}") from None
        raise ProtocolError(f"undecodable header: {e}") from None
    if msg.proto != PROTOCOL_VERSION:
        raise ProtocolVersionError(f"protocol version {msg.proto}, expected {PROTOCOL_VERSION}")
    arrays = _arrays(msg, frames[1:])
    return msg, arrays


def _wrong_proto(header) -> bool:
    try:
        raw = msgspec.msgpack.decode(header)
    except (msgspec.MsgspecError, UnicodeDecodeError):
        return False
    return isinstance(raw, dict) and raw.get("proto", PROTOCOL_VERSION) != PROTOCOL_VERSION


def _nbytes(frame) -> int:
    return frame.nbytes if isinstance(frame, memoryview) else len(frame)  # bytes, zmq.Frame: len is bytes


def _arrays(msg: Message, frames: list) -> list[np.ndarray]:
    """Array views on `frames` (no copy; a view keeps its frame alive), checked against the header."""
    expected = _frame_spec(msg)
    if len(frames) != len(expected):
        raise ProtocolError(f"{type(msg).__name__}: {len(frames)} array frames, expected {len(expected)}")
    out = []
    for i, (frame, (dtype, count)) in enumerate(zip(frames, expected)):
        nbytes, size = _nbytes(frame), dtype.itemsize
        if count == -1:  # a free length (the prompt frame of a SampleGroup): non-empty, whole items
            if nbytes == 0 or nbytes % size:
                raise ProtocolError(f"prompt frame of {nbytes} bytes is not a non-empty {dtype} array")
            count = nbytes // size
        elif nbytes != count * size:
            raise ProtocolError(f"{type(msg).__name__}: frame {i + 1} has {nbytes} bytes, expected {count} x {dtype}")
        out.append(np.frombuffer(frame, dtype=dtype, count=count))
    return out


def _frame_spec(msg: Message) -> list[tuple[np.dtype, int]]:
    """(dtype, count) of each array frame the header announces; count -1 = any length (see _arrays)."""
    if isinstance(msg, SampleGroup):
        lengths = msg.response_lengths
        n = len(lengths)
        if n == 0 or len(msg.rewards) != n or len(msg.finish_reasons) != n:
            raise ProtocolError("SampleGroup: response_lengths, rewards and finish_reasons differ in length")
        if min(lengths) < 0:
            raise ProtocolError("SampleGroup: negative response length")
        total = sum(lengths)
        return [(TOKEN_DTYPE, -1), (TOKEN_DTYPE, total), (LOGPROB_DTYPE, total)]
    if isinstance(msg, Lease):
        if any(p.n_tokens < 1 for p in msg.prompts):
            raise ProtocolError("Lease: a prompt has no tokens")
        return [(TOKEN_DTYPE, sum(p.n_tokens for p in msg.prompts))]
    if isinstance(msg, Chunk):
        if msg.length < 0 or msg.offset < 0:
            raise ProtocolError("Chunk: negative offset or length")
        return [(BYTE_DTYPE, msg.length)]
    return []
