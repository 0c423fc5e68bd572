"""Tests for offpolicy.wire.protocol: every message round-trips through encode/decode (bytes and zmq.Frame),
array frames keep dtype and values, and anything malformed raises ProtocolError."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import zmq

from offpolicy.wire import protocol
from offpolicy.wire.protocol import (
    LOGPROB_DTYPE,
    PROTOCOL_VERSION,
    TOKEN_DTYPE,
    Ack,
    Error,
    Goodbye,
    Heartbeat,
    Hello,
    Lease,
    LeasePrompt,
    ProtocolError,
    SampleGroup,
    VersionQuery,
    WeightAnnouncement,
    Welcome,
    WorkRequest,
    decode,
    encode,
)


def make_lease(lengths=(3, 2)) -> tuple[Lease, np.ndarray]:
    prompts = [LeasePrompt(prompt_id=10 + i, epoch=1, n_tokens=n, text=f"p{i}", answer=f"a{i}")
               for i, n in enumerate(lengths)]
    lease = Lease(lease_id=7, min_version=3, deadline_s=120.0, prompts=prompts)
    tokens = np.arange(1, sum(lengths) + 1, dtype=TOKEN_DTYPE)
    return lease, tokens


def make_group(lengths=(2, 3, 1)) -> tuple[SampleGroup, list[np.ndarray]]:
    n = len(lengths)
    group = SampleGroup(lease_id=7, prompt_id=11, epoch=1, weight_version=4, response_lengths=list(lengths),
                        rewards=[0.5 * i for i in range(n)], finish_reasons=["stop"] * (n - 1) + ["length"],
                        gen_seconds=0.25)
    total = sum(lengths)
    prompt = np.array([11, 5, 6, 7], dtype=TOKEN_DTYPE)
    tokens = np.arange(100, 100 + total, dtype=TOKEN_DTYPE)
    logprobs = -np.linspace(0.1, 2.0, total, dtype=LOGPROB_DTYPE)
    return group, [prompt, tokens, logprobs]


ARRAYLESS = [
    Hello(daemon_id="rollout-0@node12:4242", engine="torch", max_groups=8),
    Welcome(run="quickstart", newest_version=-1, n_samples=16, max_new_tokens=6),
    WorkRequest(credits=8),
    Ack(groups=[protocol.GroupOutcome(7, 11, True)]),
    Ack(groups=[protocol.GroupOutcome(7, 11, True), protocol.GroupOutcome(7, 12, False, "stale"),
                protocol.GroupOutcome(lease_id=8, prompt_id=3, accepted=False, reason="duplicate")]),
    Heartbeat(daemon_id="rollout-1", weight_version=3, busy_groups=2),
    VersionQuery(),
    WeightAnnouncement(version=5, path="/dev/shm/offpolicy/run/v5", total_bytes=123456, publish_seconds=0.5,
                       step=5),
    Goodbye(reason="done"),
    Error(code="bad_message", message="undecodable header: ünïcode ok"),
    protocol.RelayQuery(want=4, latest=True, wait_s=2.5),
    protocol.RelayOffer(version=4, newest=5, ended=False, manifest=b'{"version": 4}'),
    protocol.RelayOffer(version=-1, newest=-1),
    protocol.ChunkRequest(version=4, file="model-00001-of-00002.safetensors", offset=4 << 20, length=4 << 20),
    protocol.RelayMissing(version=4, reason="collected"),
]


def as_bytes(frames) -> list[bytes]:
    return [bytes(f) for f in frames]


def as_zmq(frames) -> list[zmq.Frame]:
    return [zmq.Frame(bytes(f)) for f in frames]


FRAME_KINDS = {"raw": list, "bytes": as_bytes, "zmq": as_zmq}


def test_fixtures_cover_every_message_type():
    covered = {type(m) for m in ARRAYLESS} | {Lease, SampleGroup, protocol.Chunk}
    assert covered == set(protocol.Message.__args__)


# --- round trips -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", FRAME_KINDS)
@pytest.mark.parametrize("msg", ARRAYLESS, ids=lambda m: type(m).__name__)
def test_arrayless_message_round_trips(msg, kind):
    frames = encode(msg)
    assert len(frames) == 1
    got, arrays = decode(FRAME_KINDS[kind](frames))
    assert got == msg and type(got) is type(msg)
    assert got.proto == PROTOCOL_VERSION
    assert arrays == []


@pytest.mark.parametrize("kind", FRAME_KINDS)
def test_lease_round_trips_with_its_token_frame(kind):
    lease, tokens = make_lease()
    frames = encode(lease, tokens)
    assert len(frames) == 2
    got, arrays = decode(FRAME_KINDS[kind](frames))
    assert got == lease
    assert got.prompts[1] == LeasePrompt(prompt_id=11, epoch=1, n_tokens=2, text="p1", answer="a1")
    assert len(arrays) == 1
    assert arrays[0].dtype == TOKEN_DTYPE
    np.testing.assert_array_equal(arrays[0], tokens)


def test_lease_with_no_prompts_round_trips():
    lease = Lease(lease_id=1, min_version=0, deadline_s=1.0, prompts=[])
    got, arrays = decode(as_bytes(encode(lease, np.zeros(0, TOKEN_DTYPE))))
    assert got == lease and arrays[0].size == 0


@pytest.mark.parametrize("kind", FRAME_KINDS)
def test_sample_group_round_trips_with_its_three_frames(kind):
    group, arrays = make_group()
    frames = encode(group, *arrays)
    assert len(frames) == 4
    got, out = decode(FRAME_KINDS[kind](frames))
    assert got == group
    assert [a.dtype for a in out] == [TOKEN_DTYPE, TOKEN_DTYPE, LOGPROB_DTYPE]
    for a, b in zip(out, arrays):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kind", FRAME_KINDS)
def test_chunk_round_trips_its_raw_bytes_frame(kind):
    data = np.frombuffer(bytes(range(256)) * 3, dtype=np.uint8)
    chunk = protocol.Chunk(version=2, file="config.json", offset=10, length=data.size)
    got, arrays = decode(FRAME_KINDS[kind](encode(chunk, data)))
    assert got == chunk and arrays[0].tobytes() == data.tobytes()
    empty = protocol.Chunk(version=2, file="config.json", offset=0, length=0)
    assert decode(as_bytes(encode(empty, np.zeros(0, np.uint8))))[1][0].size == 0


@pytest.mark.parametrize("length, nbytes", [(3, 4), (4, 3), (-1, 0)])
def test_chunk_whose_frame_disagrees_with_its_length_is_refused(length, nbytes):
    header = encode(protocol.Chunk(version=0, file="f", offset=0, length=length), np.zeros(max(length, 0), np.uint8))[0]
    with pytest.raises(ProtocolError):
        decode([header, b"x" * nbytes])


def test_sample_group_prompt_frame_length_is_free():
    group, arrays = make_group()
    long_prompt = np.arange(1, 300, dtype=TOKEN_DTYPE)
    _, out = decode(as_bytes(encode(group, long_prompt, arrays[1], arrays[2])))
    np.testing.assert_array_equal(out[0], long_prompt)


def test_sample_group_with_empty_responses_round_trips():
    group, arrays = make_group(lengths=(0, 0))
    assert arrays[1].size == 0 and arrays[2].size == 0
    _, out = decode(as_bytes(encode(group, *arrays)))
    assert out[1].size == 0 and out[2].size == 0 and out[1].dtype == TOKEN_DTYPE


def test_extreme_values_survive_the_round_trip():
    group, arrays = make_group(lengths=(2,))
    group = msgspec.structs.replace(group, rewards=[-1e300], weight_version=2**40)
    tokens = np.array([np.iinfo(np.int32).min, np.iinfo(np.int32).max], dtype=TOKEN_DTYPE)
    logprobs = np.array([-np.inf, np.nan], dtype=LOGPROB_DTYPE)
    got, out = decode(as_bytes(encode(group, arrays[0], tokens, logprobs)))
    assert got.rewards == [-1e300] and got.weight_version == 2**40
    np.testing.assert_array_equal(out[1], tokens)
    assert out[2][0] == -np.inf and np.isnan(out[2][1])


def test_non_contiguous_arrays_are_sent_contiguous():
    lease, tokens = make_lease()
    strided = np.stack([tokens, -tokens], axis=1)[:, 0]
    assert not strided.flags.c_contiguous
    _, out = decode(as_bytes(encode(lease, strided)))
    np.testing.assert_array_equal(out[0], tokens)


def test_array_frames_are_raw_little_endian_bytes():
    group, arrays = make_group(lengths=(2,))
    frames = encode(group, *arrays)
    assert bytes(frames[1]) == arrays[0].astype("<i4").tobytes()
    assert bytes(frames[2]) == np.array([100, 101], dtype="<i4").tobytes()
    assert bytes(frames[3]) == arrays[2].astype("<f4").tobytes()


def test_wire_dtypes_are_little_endian_int32_and_float32():
    assert TOKEN_DTYPE == np.dtype("<i4") and LOGPROB_DTYPE == np.dtype("<f4")


def test_encode_with_a_wrong_dtype_never_silently_changes_tokens():
    group, arrays = make_group()
    prompt64 = arrays[0].astype(np.int64)
    try:
        _, out = decode(as_bytes(encode(group, prompt64, arrays[1], arrays[2])))
    except (ProtocolError, TypeError, ValueError):
        return
    np.testing.assert_array_equal(out[0], arrays[0])


# --- no pickle: frame 0 is plain msgpack ----------------------------------------------------------


@pytest.mark.parametrize("msg, arrays", [*((m, ()) for m in ARRAYLESS), (make_lease()[0], (make_lease()[1],)),
                                         make_group()], ids=lambda m: type(m).__name__)
def test_header_is_a_plain_msgpack_map_with_type_and_proto(msg, arrays):
    header = bytes(encode(msg, *arrays)[0])
    assert not header.startswith(b"\x80")  # a pickle stream opens with PROTO (0x80)
    raw = msgspec.msgpack.decode(header)
    assert isinstance(raw, dict)
    assert raw["type"] == msg.__struct_config__.tag
    assert raw["proto"] == PROTOCOL_VERSION


def test_token_ids_never_travel_in_the_header():
    group, arrays = make_group()
    raw = msgspec.msgpack.decode(bytes(encode(group, *arrays)[0]))
    assert set(raw) == {"type", "proto", "lease_id", "prompt_id", "epoch", "weight_version", "response_lengths",
                        "rewards", "finish_reasons", "gen_seconds"}  # version_runs only where a response switched


def test_array_frames_are_zero_copy_views():
    tokens = np.arange(1, 6, dtype=TOKEN_DTYPE)
    lease, _ = make_lease(lengths=(5,))
    frames = encode(lease, tokens)
    assert isinstance(frames[1], memoryview) and frames[1].format == "B" and frames[1].nbytes == 20
    tokens[0] = 42  # the frame is a view of the caller's buffer, not a copy
    assert bytes(frames[1])[:4] == np.array([42], "<i4").tobytes()


# --- array frame checks -----------------------------------------------------------------------------


def lease_frames(lease: Lease, tokens: np.ndarray) -> list[bytes]:
    return as_bytes(encode(lease, tokens))


@pytest.mark.parametrize("extra", [0, 2])
def test_lease_with_wrong_frame_count_is_refused(extra):
    lease, tokens = make_lease()
    frames = lease_frames(lease, tokens)[:1] + [tokens.tobytes()] * extra
    with pytest.raises(ProtocolError, match=rf"Lease: {extra} array frames, expected 1"):
        decode(frames)


@pytest.mark.parametrize("delta", [-1, 1])
def test_lease_with_wrong_token_count_is_refused(delta):
    lease, tokens = make_lease()
    wrong = np.arange(1, tokens.size + 1 + delta, dtype=TOKEN_DTYPE)
    with pytest.raises(ProtocolError, match=r"Lease: frame 1 has \d+ bytes, expected 5 x int32"):
        decode(lease_frames(lease, wrong))


def test_lease_frame_with_a_partial_token_is_refused():
    lease, tokens = make_lease()
    frames = lease_frames(lease, tokens)
    frames[1] = frames[1] + b"\x00"
    with pytest.raises(ProtocolError, match="frame 1 has 21 bytes"):
        decode(frames)


@pytest.mark.parametrize("n_tokens", [0, -1])
def test_lease_prompt_without_tokens_is_refused(n_tokens):
    lease, tokens = make_lease(lengths=(3,))
    lease.prompts.append(LeasePrompt(prompt_id=99, epoch=1, n_tokens=n_tokens))
    with pytest.raises(ProtocolError, match="a prompt has no tokens"):
        decode(lease_frames(lease, tokens))


@pytest.mark.parametrize("count", [2, 4, 0])
def test_sample_group_with_wrong_frame_count_is_refused(count):
    group, arrays = make_group()
    frames = as_bytes(encode(group, *arrays))
    frames = frames[:1] + (frames[1:] + [frames[1]])[:count]
    with pytest.raises(ProtocolError, match=rf"SampleGroup: {count} array frames, expected 3"):
        decode(frames)


@pytest.mark.parametrize("frame, nbytes", [(2, 20), (2, 28), (3, 20), (3, 25)])
def test_sample_group_frame_with_wrong_byte_length_is_refused(frame, nbytes):
    group, arrays = make_group()  # 6 response tokens: 24 bytes in frames 2 and 3
    frames = as_bytes(encode(group, *arrays))
    frames[frame] = bytes(nbytes)
    with pytest.raises(ProtocolError, match=rf"SampleGroup: frame {frame} has {nbytes} bytes, expected 6 x"):
        decode(frames)


@pytest.mark.parametrize("prompt", [b"", b"\x01\x00\x00", b"\x01" * 9])
def test_sample_group_prompt_frame_must_be_a_non_empty_int32_array(prompt):
    group, arrays = make_group()
    frames = as_bytes(encode(group, *arrays))
    frames[1] = prompt
    with pytest.raises(ProtocolError, match=rf"prompt frame of {len(prompt)} bytes"):
        decode(frames)


@pytest.mark.parametrize("field, value", [
    ("rewards", [0.0, 1.0]),
    ("rewards", [0.0, 1.0, 2.0, 3.0]),
    ("finish_reasons", ["stop"]),
    ("response_lengths", [2, 3]),
    ("response_lengths", []),
])
def test_sample_group_lists_of_different_lengths_are_refused(field, value):
    group, arrays = make_group()
    group = msgspec.structs.replace(group, **{field: value})
    with pytest.raises(ProtocolError, match="differ in length"):
        decode(as_bytes(encode(group, *arrays)))


def test_sample_group_negative_length_is_refused():
    group, arrays = make_group(lengths=(2, 3, 1))
    group = msgspec.structs.replace(group, response_lengths=[4, -1, 3])  # the sum still matches the frames
    with pytest.raises(ProtocolError, match="negative response length"):
        decode(as_bytes(encode(group, *arrays)))


@pytest.mark.parametrize("msg", ARRAYLESS, ids=lambda m: type(m).__name__)
def test_arrayless_message_with_an_array_frame_is_refused(msg):
    with pytest.raises(ProtocolError, match=rf"{type(msg).__name__}: 1 array frames, expected 0"):
        decode(as_bytes(encode(msg)) + [b"\x00\x00\x00\x00"])


# --- headers that are not messages ----------------------------------------------------------------


def test_empty_frame_list_is_refused():
    with pytest.raises(ProtocolError, match="empty message"):
        decode([])


@pytest.mark.parametrize("header", [b"", b"\xc1", b"\xff\xfe garbage", b"\x85\xa4type"])
def test_garbage_header_is_refused(header):
    with pytest.raises(ProtocolError, match="undecodable header"):
        decode([header])


def test_garbage_header_in_a_zmq_frame_is_refused():
    with pytest.raises(ProtocolError, match="undecodable header"):
        decode([zmq.Frame(b"\xff\xfe garbage")])


@pytest.mark.parametrize("value", [5, "hello", [1, 2], None])
def test_header_that_is_not_a_map_is_refused(value):
    with pytest.raises(ProtocolError, match=r"undecodable header: Expected `object`"):
        decode([msgspec.msgpack.encode(value)])


def test_unknown_type_tag_is_refused_naming_the_tag():
    header = msgspec.msgpack.encode({"type": "launch_missiles", "proto": PROTOCOL_VERSION})
    with pytest.raises(ProtocolError, match=r"undecodable header: Invalid value 'launch_missiles'.*\$\.type"):
        decode([header])


def test_missing_type_tag_is_refused():
    header = msgspec.msgpack.encode({"proto": PROTOCOL_VERSION, "credits": 1})
    with pytest.raises(ProtocolError, match="missing required field `type`"):
        decode([header])


def test_wrong_protocol_version_of_a_valid_message_is_refused():
    header = msgspec.msgpack.encode({"type": "work", "proto": 99, "credits": 1})
    with pytest.raises(ProtocolError, match=rf"protocol version 99, expected {PROTOCOL_VERSION}"):
        decode([header])


@pytest.mark.parametrize("raw", [
    {"type": "hello", "proto": 99},  # a future version whose fields this one does not know
    {"type": "hello", "proto": 99, "daemon_id": "a", "engine": "torch", "max_groups": 1, "new_field": 1},
    {"type": "version?", "proto": "1"},
])
def test_wrong_protocol_version_is_reported_as_such_even_if_the_rest_does_not_decode(raw):
    with pytest.raises(ProtocolError, match=rf"protocol version .*expected {PROTOCOL_VERSION}"):
        decode([msgspec.msgpack.encode(raw)])


def test_wrong_protocol_version_in_a_zmq_frame_is_refused():
    header = msgspec.msgpack.encode({"type": "hello", "proto": 99})
    with pytest.raises(ProtocolError, match="protocol version"):
        decode([zmq.Frame(header)])


def test_missing_proto_means_this_version():
    msg, _ = decode([msgspec.msgpack.encode({"type": "work", "credits": 3})])
    assert msg == WorkRequest(credits=3)


def test_unknown_extra_field_is_refused():
    raw = msgspec.msgpack.decode(bytes(encode(WorkRequest(credits=1))[0]))
    raw["priority"] = "high"
    with pytest.raises(ProtocolError, match="unknown field `priority`"):
        decode([msgspec.msgpack.encode(raw)])


def test_unknown_extra_field_in_a_lease_prompt_is_refused():
    lease, tokens = make_lease(lengths=(2,))
    raw = msgspec.msgpack.decode(bytes(encode(lease, tokens)[0]))
    raw["prompts"][0]["system"] = "be nice"
    with pytest.raises(ProtocolError, match=r"unknown field `system`.*prompts\[0\]"):
        decode([msgspec.msgpack.encode(raw), tokens.tobytes()])


@pytest.mark.parametrize("field, value", [("credits", "8"), ("credits", 1.5), ("credits", True), ("credits", None)])
def test_wrong_field_type_is_refused(field, value):
    header = msgspec.msgpack.encode({"type": "work", "proto": PROTOCOL_VERSION, field: value})
    with pytest.raises(ProtocolError, match=r"undecodable header: Expected `int`"):
        decode([header])


def test_missing_required_field_is_refused():
    header = msgspec.msgpack.encode({"type": "hello", "proto": PROTOCOL_VERSION, "daemon_id": "a"})
    with pytest.raises(ProtocolError, match="missing required field"):
        decode([header])


def test_protocol_error_is_a_value_error():
    assert issubclass(ProtocolError, ValueError)


def test_invalid_utf8_in_a_header_key_is_a_protocol_error():
    # found by the hub fuzzer: msgspec raises UnicodeDecodeError, not DecodeError, for such keys
    header = b"\x85\xa4type\xa5hello\xa9daemon_id\xa5fuzz\xa6engioe\xa5torch\xaamax_groups\x18\xa5proto\x01"
    with pytest.raises(ProtocolError):
        decode([header])


# --- Ack (protocol 2): the outcomes of one or more groups ------------------------------------------


def test_ack_outcomes_travel_as_compact_arrays_in_arrival_order():
    ack = Ack(groups=[protocol.GroupOutcome(7, 11, True), protocol.GroupOutcome(7, 12, False, "stale")])
    raw = msgspec.msgpack.decode(bytes(encode(ack)[0]))
    assert raw == {"type": "ack", "proto": PROTOCOL_VERSION, "groups": [[7, 11, True, ""], [7, 12, False, "stale"]]}
    got, _ = decode(as_zmq(encode(ack)))
    assert [(g.prompt_id, g.accepted, g.reason) for g in got.groups] == [(11, True, ""), (12, False, "stale")]


@pytest.mark.parametrize("outcome", [[7, 11], [7, 11, "yes", ""], [7, 11, True, "", "extra"], {"lease_id": 7}])
def test_malformed_ack_outcome_is_refused(outcome):
    header = msgspec.msgpack.encode({"type": "ack", "proto": PROTOCOL_VERSION, "groups": [outcome]})
    with pytest.raises(ProtocolError, match=r"undecodable header: .*\$\.groups\[0\]"):
        decode([header])


def test_a_protocol_1_ack_is_a_version_error():
    header = msgspec.msgpack.encode({"type": "ack", "proto": 1, "lease_id": 7, "prompt_id": 11, "accepted": True})
    with pytest.raises(protocol.ProtocolVersionError, match=rf"expected {PROTOCOL_VERSION}"):
        decode([header])


def test_array_frames_are_writable_views_on_zmq_frames():
    group, arrays = make_group()
    frames = as_zmq(encode(group, *arrays))
    _, got = decode(frames)
    for a, frame in zip(got, frames[1:]):
        assert a.base is frame and a.flags.writeable and not a.flags.owndata


@pytest.mark.parametrize("field, value", [("max_groups", 0), ("max_groups", -1), ("daemon_id", ""),
                                          ("daemon_id", "x" * 257), ("engine", "x" * 65)])
def test_hello_with_an_out_of_range_field_is_refused(field, value):
    raw = msgspec.msgpack.decode(as_bytes(encode(Hello(daemon_id="r0", engine="torch", max_groups=8)))[0])
    raw[field] = value
    with pytest.raises(ProtocolError, match=field):
        decode([msgspec.msgpack.encode(raw)])


def test_a_group_made_by_one_version_encodes_as_before_version_runs_existed():
    """`SampleGroup` leaves fields at their defaults out: a hub from before `version_runs` decodes a group that
    switched no version in flight, and refuses one that did (it could not honour it)."""
    import msgspec

    from offpolicy.wire.protocol import SampleGroup, VersionRun

    class OldSampleGroup(msgspec.Struct, tag_field="type", tag="group", forbid_unknown_fields=True, kw_only=True):
        proto: int
        lease_id: int
        prompt_id: int
        epoch: int
        weight_version: int
        response_lengths: list[int]
        rewards: list[float]
        finish_reasons: list[str]
        gen_seconds: float = 0.0

    fields = dict(lease_id=1, prompt_id=2, epoch=0, weight_version=5, response_lengths=[3], rewards=[1.0],
                  finish_reasons=["stop"], gen_seconds=0.5)
    old = msgspec.msgpack.decode(msgspec.msgpack.encode(SampleGroup(**fields)), type=OldSampleGroup)
    assert (old.weight_version, old.gen_seconds) == (5, 0.5)
    switched = SampleGroup(**fields, version_runs=[[VersionRun(0, 5), VersionRun(2, 6)]])
    with pytest.raises(msgspec.ValidationError, match="version_runs"):
        msgspec.msgpack.decode(msgspec.msgpack.encode(switched), type=OldSampleGroup)
