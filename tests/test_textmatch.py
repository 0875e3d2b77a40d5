"""Text conditions' bounded matching (textmatch.py), on its own and on the real server."""

from __future__ import annotations

import concurrent.futures
import time

import grpc
import pytest
import tracewire
from trace_requests import invoke, iv, run, steps, trace
from tracewire.v1 import intervention_pb2 as I
from tracewire_server.shared import textmatch
from tracewire_server.shared.textmatch import TEXT_WINDOW, TextScan

GREEDY = dict(temperature=0.0, ignore_eos=True)


def scanned(text: str, needles: tuple[str, ...] = (), piece: int = 997) -> TextScan:
    """A TextScan extended with `text` in pieces, as a generation's steps would."""
    scan = TextScan(needles)
    for i in range(0, len(text), piece):
        scan.extend(text[i:i + piece])
    return scan


def test_contains_is_exact_over_the_whole_text_as_it_grows():
    scan = TextScan(["needle"])
    scan.extend("x" * 10_000)
    assert not scan.contains("needle")
    scan.extend("nee")
    assert not scan.contains("needle")
    scan.extend("dle" + "y" * 10_000)  # the needle straddles two steps
    assert scan.contains("needle")
    scan.extend("z")
    assert scan.contains("needle")  # found stays found
    assert scanned("a needle at the start" + "y" * 10_000, ("needle",)).contains("needle")
    assert scanned("x" * 10_000 + "needle", ("needle",), piece=1).contains("needle")  # a character a step


def test_matches_searches_the_window_with_its_context():
    assert scanned("Paris.").matches(r"[.!?]$")
    assert scanned("start " + "y" * 10).matches(r"^start")
    long = "start " + "y" * (2 * TEXT_WINDOW)
    assert not scanned(long).matches(r"^start")  # outside the window
    assert not scanned(long).matches(r"^y")  # `^` is the text's start, not the window's
    assert not scanned(long).matches(r"\by")  # the character before the window is context
    assert scanned(long + " end").matches(r"\bend$")


@pytest.mark.parametrize("pattern, why", [
    (r"(a)\1", "invalid escape"),
    (r"(?<=a)b", "perl operator"),
    ("a" * (textmatch.MAX_PATTERN_CHARS + 1), "at most"),
    (r"((a{100}){100}){100}", "RE2"),
])
def test_patterns_re2_cannot_bound_are_refused(pattern, why):
    with pytest.raises(textmatch.PatternError, match=why):
        textmatch.compile_pattern(pattern)


def test_refused_patterns_name_the_field(stub):
    for pattern in [r"(a)\1", "(" * 2000]:
        with pytest.raises(grpc.RpcError) as info:
            run(stub, trace(invoke("a", iv(when=I.Condition(text_matches=pattern), stop=I.Stop())), max_tokens=2))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        field = tracewire.errors.from_rpc_error(info.value).field
        assert field == "invokes[0].interventions[0].condition.text_matches"


def test_a_catastrophic_pattern_stalls_no_one(stub, client, hf):
    """`(a+)+b` over 30 forced "a" tokens backtracked for 108 s in Python's re, on the
    engine's thread, stalling every request; RE2 decides it in linear time."""
    a = hf.encode("a")[0]
    request = trace(invoke("a", iv(force_sample=I.ForceSample(token_id=a)),
                           iv(when=I.Condition(text_matches=r"(a+)+b"), stop=I.Stop())),
                    max_tokens=30, **GREEDY)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        hostile = pool.submit(run, stub, request, 60)
        started = time.monotonic()
        (plain,) = client.generate("The capital of France is", temperature=0.0, max_tokens=8, ignore_eos=True)
        result = hostile.result()
    assert plain.outputs[0].token_ids == hf.greedy(hf.encode("The capital of France is"), 8)
    assert result.tokens() == [a] * 30 and not any(s.stopped for s in result.seq())
    assert time.monotonic() - started < 60
    gated = run(stub, trace(invoke("a", iv(force_sample=I.ForceSample(token_id=a)),
                                   iv(sel=steps(start=3), when=I.Condition(text_matches=r"^(a+)+$"), stop=I.Stop())),
                            max_tokens=30, **GREEDY))
    assert len(gated.tokens()) == 4  # the same kind of pattern, where it matches
