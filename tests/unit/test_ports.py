"""offpolicy/plumbing/ports.py: listening ports below the kernel's ephemeral range, never handed out twice in a row."""

from __future__ import annotations

import socket

from offpolicy.plumbing import ports


def test_ports_come_from_below_the_ephemeral_range_free_and_distinct():
    first, end = ports.listening_range()
    low = int(ports.RANGE.read_text().split()[0]) if ports.RANGE.exists() else 32768
    assert end <= low or (first, end) == (1024, 65536)
    got = ports.free_ports(5) + ports.free_ports(5)
    assert len(set(got)) == 10 and all(first <= p < end for p in got)  # successive calls never repeat one
    for p in got:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_taken_port_is_skipped_and_a_block_is_consecutive_and_then_passed():
    (p,) = ports.free_ports(1)
    with socket.socket() as held:
        held.bind(("127.0.0.1", p + 1))  # the walk's next port, taken by another process
        held.listen()
        q = ports.free_ports(1)[0]
        assert q != p + 1
    base = ports.free_block(4)
    nxt = ports.free_ports(1)[0]
    assert nxt not in range(base, base + 4)  # the walk went past the block


def test_a_range_too_low_to_leave_room_falls_back_to_every_unprivileged_port(monkeypatch, tmp_path):
    f = tmp_path / "range"
    f.write_text("10500\t60999\n")
    monkeypatch.setattr(ports, "RANGE", f)
    assert ports.listening_range() == (1024, 65536)
    f.write_text("40000\t60999\n")
    assert ports.listening_range() == (10000, 40000)
