"""The exchange's threads: one exchange's collectives never overlap the next one's."""

from __future__ import annotations

import threading
import time

from veriloco.exchange import Exchange


def test_a_new_exchange_waits_for_the_previous_ones_collectives():
    # two exchanges in flight on one process group would issue their collectives from two
    # threads; ranks could order them differently and deadlock (seen under heavy load)
    ex = Exchange.__new__(Exchange)
    ex.link, ex._last, ex.on_packets = None, None, None
    spans: list[tuple[str, float, float]] = []
    lock = threading.Lock()

    def fake_run(packet: bytes, box: dict) -> None:
        t0 = time.perf_counter()
        time.sleep(0.3 if packet == b"first" else 0.0)
        with lock:
            spans.append((packet.decode(), t0, time.perf_counter()))
        box.update(packets=[packet], sent=0, received=0)

    ex._run = fake_run
    first = ex.start(b"first")
    second = ex.start(b"second")  # started while the first is still "moving bytes"
    assert second.wait() == [b"second"] and first.wait() == [b"first"]
    (_, _, first_end), (_, second_start, _) = sorted(spans)  # "first" < "second"
    assert second_start >= first_end


def test_a_forgotten_exchange_holds_no_packet():
    # a round lets the received bundles go once they are decoded (round.start_finish): the handle
    # must not keep them alive, and a later wait() must fail rather than return nothing
    import gc
    import weakref

    import pytest

    from veriloco.exchange import ExchangeError

    class Packet(bytearray):  # a packet that a weak reference can watch (bytes cannot have one)
        pass

    ex = Exchange.__new__(Exchange)
    ex.link, ex._last, ex.on_packets = None, None, None
    ex._run = lambda packet, box: box.update(packets=[packet, Packet(b"theirs")], sent=0, received=0)
    handle = ex.start(b"mine")
    got = handle.wait()
    theirs = weakref.ref(got[1])
    assert handle.wait() is got  # waited twice: the same list
    del got
    handle.forget()
    gc.collect()
    assert theirs() is None
    with pytest.raises(ExchangeError, match="let go"):
        handle.wait()
