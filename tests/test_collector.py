"""The worker's step collector: steps finish in order, drain waits for all of them,
submit waits when too many are outstanding, and a failing step does not stop the rest.
(The threaded mode serves GPU engines; the CPU engines of this suite run it inline.)"""

import threading
import time

from tracewire_server.worker.collector import StepCollector


def test_threaded_steps_finish_in_order_and_drain_waits():
    done: list[int] = []

    def finish(i: int) -> None:
        time.sleep(0.001 * (i % 3))  # uneven work must not reorder steps
        if i == 5:
            raise RuntimeError("one bad step")
        done.append(i)

    collector = StepCollector(finish)
    for i in range(40):
        collector.submit(i)
    collector.drain()
    assert done == [i for i in range(40) if i != 5]


def test_submit_waits_when_too_many_steps_are_outstanding():
    gate = threading.Event()
    collector = StepCollector(lambda i: gate.wait(5), max_outstanding=2)
    collector.submit(0)
    collector.submit(1)
    third = threading.Thread(target=collector.submit, args=(2,))
    third.start()
    third.join(0.2)
    assert third.is_alive()  # held back: two steps outstanding
    gate.set()
    third.join(5)
    assert not third.is_alive()
    collector.drain()


def test_inline_mode_finishes_inside_submit():
    done: list[int] = []
    collector = StepCollector(done.append, threaded=False)
    collector.submit(7)
    assert done == [7]
    collector.drain()
