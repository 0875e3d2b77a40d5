"""Activation patching on a compiled engine (steering tables: a patched row is a replace, an
add_read an add, by the source's stored row, in a slot of its own for that forward pass),
against transformers doing the same copy: test_patching.py's checks, on the session's
compiled server (conftest's `graph`: tables and read buffers on layers 0-2)."""

from __future__ import annotations

import grpc
import pytest
from test_patching import (
    CLEAN,
    CORRUPTED,
    GREEDY,
    check_prompt_position_patches,
    check_step_patch,
    check_sweep,
    check_units_patch,
    patch_at,
    prompt_read,
)
from trace_requests import invoke, run, trace
from tracewire.v1 import service_pb2_grpc


@pytest.fixture(scope="module")
def gstub(graph):
    with grpc.insecure_channel(graph.target) as channel:
        yield service_pb2_grpc.TraceServiceStub(channel)


def test_prompt_position_patches_equal_hfs_copies(gstub, hf):
    check_prompt_position_patches(gstub, hf)


def test_a_generation_step_patch_equals_hf_copying_during_its_greedy_loop(gstub, hf):
    check_step_patch(gstub, hf)


def test_the_sweep_equals_separate_hf_runs(graph, hf):
    check_sweep(graph.target, hf)


def test_heads_and_neurons_patch_from_the_sources_same_units(graph, hf):
    check_units_patch(graph.target, hf)


def test_a_layer_without_tables_is_refused_naming_the_field(gstub):
    request = trace(invoke(CLEAN, prompt_read("clean", 2, 3)), invoke(CORRUPTED, patch_at(3, 3, "clean", 3)),
                    max_tokens=1, **GREEDY)
    with pytest.raises(grpc.RpcError) as error:
        run(gstub, request)
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "invokes[1].interventions[0].write_module.module" in error.value.details()
    assert "not on 'layers.3'" in error.value.details()


def test_more_patched_rows_than_a_pass_has_slots_fails_that_trace_only_saying_so(gstub, hf):
    """The graph server holds 32 sequences (conftest), so a pass has 32 patch slots per
    table: a target patching 40 prompt positions at once fails, naming the limit; a trace
    beside it and the next patching trace are served."""
    prompt = " ".join(["one two three four five"] * 9)  # 45 tokens
    assert len(hf.encode(prompt)) >= 41
    positions = list(range(40))
    read = prompt_read("src", 1, *positions)
    write = patch_at(1, 0, "src", 0)
    write.write_module.positions.prompt_list.positions[:] = positions
    del write.write_module.patch.positions[:]  # every row of the source's read, in order
    with pytest.raises(grpc.RpcError) as error:
        run(gstub, trace(invoke(prompt, read), invoke(prompt, write), max_tokens=1, **GREEDY))
    assert "more than 32 patched rows at layer 1 in one forward pass" in error.value.details()
    check_prompt_position_patches(gstub, hf)  # the slots are free again
