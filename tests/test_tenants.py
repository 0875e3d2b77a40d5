"""tenants.py on its own: the per-tenant ledger with a fake clock, no server."""

from __future__ import annotations

import pytest
from tracewire_server.frontend.errors import ResourceExhausted
from tracewire_server.frontend.tenants import WINDOW_SECONDS, TenantCall, TenantLedger, TenantQuotas


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def ledger(**quotas: int) -> tuple[TenantLedger, FakeClock]:
    clock = FakeClock()
    return TenantLedger(TenantQuotas(**quotas), clock), clock


def test_calls_in_flight_are_capped_per_tenant_and_freed_on_close():
    book, _ = ledger(max_calls=2)
    first, second = book.open_call("alice"), book.open_call("alice")
    with pytest.raises(ResourceExhausted, match=r"--tenant-max-calls 2"):
        book.open_call("alice")
    bob = book.open_call("bob")  # another tenant is not held back by alice
    first.close()
    first.close()  # idempotent: a second close gives nothing back twice
    third = book.open_call("alice")
    assert book.held("alice") == (2, 0)
    for call in (second, third, bob):
        call.close()
    assert book.held("alice") == (0, 0)


def test_sequences_are_reserved_all_or_nothing_and_given_back_with_the_call():
    book, _ = ledger(max_sequences=4)
    a = book.open_call("alice")
    a.reserve_sequences(3)
    b = book.open_call("alice")
    with pytest.raises(ResourceExhausted, match=r"--tenant-max-sequences 4"):
        b.reserve_sequences(2)
    assert book.held("alice") == (2, 3)  # the refused reservation holds nothing
    b.reserve_sequences(1)
    a.close()
    assert book.held("alice") == (1, 1)
    b.close()
    assert book.held("alice") == (0, 0)


def test_read_bytes_are_a_sliding_minute_budget():
    book, clock = ledger(read_bytes_per_minute=1000)
    call = book.open_call("alice")
    call.charge_reads(600)
    with pytest.raises(ResourceExhausted, match=r"read 600 of its 1000 bytes.*--tenant-read-bytes-per-minute"):
        call.charge_reads(500)
    call.charge_reads(400)  # exactly the budget
    clock.now += WINDOW_SECONDS / 2
    with pytest.raises(ResourceExhausted):
        call.charge_reads(1)
    clock.now += WINDOW_SECONDS / 2  # the first charges have aged out
    call.charge_reads(1000)
    with pytest.raises(ResourceExhausted, match=r"more than tenant 'alice' may read in a minute"):
        call.charge_reads(1001)  # never fits, whatever the window holds
    call.close()


def test_spent_read_bytes_outlive_the_call():
    book, clock = ledger(read_bytes_per_minute=100)
    call = book.open_call("alice")
    call.charge_reads(100)
    call.close()  # bytes are spent, not held: closing gives none back
    with pytest.raises(ResourceExhausted):
        book.open_call("alice").charge_reads(1)
    clock.now += WINDOW_SECONDS + 1
    book.open_call("alice").charge_reads(100)


def test_zero_means_unlimited():
    book, _ = ledger(max_calls=0, max_sequences=0, read_bytes_per_minute=0)
    calls = [book.open_call("alice") for _ in range(1000)]
    for call in calls:
        call.reserve_sequences(1000)
        call.charge_reads(1 << 40)
    assert book.held("alice") == (1000, 1_000_000)


def test_an_unmetered_call_counts_nothing():
    call = TenantCall.unmetered()
    call.reserve_sequences(1 << 20)
    call.charge_reads(1 << 40)
    call.close()


def test_a_tenant_that_leaves_leaves_nothing_behind():
    book, _ = ledger(max_calls=1)
    for _ in range(3):
        call = book.open_call("alice")
        call.reserve_sequences(5)
        call.close()
    assert book._tenants == {}


def test_patch_store_bytes_are_held_per_tenant_while_the_call_runs():
    book, _ = ledger(patch_store_bytes=1000)
    a, b = book.open_call("alice"), book.open_call("alice")
    a.hold_patch_bytes(700, "invokes[0].interventions[0] (read 'clean')")
    with pytest.raises(ResourceExhausted, match=r"would hold 1100 bytes.*read 'x'.*--tenant-patch-store-bytes 1000"):
        b.hold_patch_bytes(400, "invokes[0].interventions[0] (read 'x')")
    book.open_call("bob").hold_patch_bytes(1000, "")  # another tenant has its own
    b.hold_patch_bytes(300, "")
    a.close()
    b.hold_patch_bytes(700, "")  # alice's first call gave its bytes back
    with pytest.raises(ResourceExhausted):
        b.hold_patch_bytes(1, "")
    b.close()
    unlimited, _ = ledger(patch_store_bytes=0)
    unlimited.open_call("alice").hold_patch_bytes(1 << 40, "")
