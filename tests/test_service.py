"""Tokenizer RPCs, model info, health, reflection, engine stats, aborts."""

from __future__ import annotations

import re

import grpc
import pytest
import tracewire
from conftest import MODEL, engine_stats, wait_for_unfinished
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)


def test_tokenize_detokenize_round_trip_equals_hf(client, hf):
    for text in ["The capital of France is", " Berlin", "Hello, world!\nNew line  two spaces"]:
        ids = client.tokenizer.encode(text)
        assert ids == hf.encode(text)
        assert client.tokenizer.decode(ids) == text
    assert client.tokenizer.decode(client.tokenizer.encode(" Paris")[0]) == " Paris"


def test_model_info_describes_the_served_model(client, hf):
    info = client.model_info()
    cfg = hf.model.config
    assert info.architecture == "Qwen3ForCausalLM"
    assert info.vocab_size == cfg.vocab_size
    assert info.num_layers == cfg.num_hidden_layers
    assert info.hidden_size == cfg.hidden_size
    assert info.max_model_len == 512
    assert info.dtype == "float32"
    assert hf.tokenizer.eos_token_id in info.eos_token_ids
    assert info.model == str(MODEL)
    paths = [m.path for m in info.modules]
    assert paths[0] == "embed_tokens" and paths[-2:] == ["norm", "lm_head"]
    assert f"layers.{cfg.num_hidden_layers - 1}.mlp" in paths
    assert info.vllm_version and info.server_version == tracewire.__version__
    # compiled, with the default graph hooks on every layer (the tiny model fits them all)
    everything = list(range(cfg.num_hidden_layers))
    assert info.engine_mode == "compiled_steering" and info.steerable_layers == everything
    assert info.readable_layers == everything and info.unit_steerable_layers == everything


def test_health_went_not_serving_then_serving(server):
    assert server.health_seen[-1] == "SERVING"
    assert "NOT_SERVING" in server.health_seen, server.health_seen
    assert server.health() == "SERVING"


def test_startup_heap_is_frozen_out_of_the_gc(server):
    # A full collection over vLLM's and torch's objects stalls the event loop for ~0.3 s
    # on this machine: the server freezes them once SERVING, and says how many.
    counts = [int(n) for n in re.findall(r"(\d+) startup objects frozen out of the GC", server.log())]
    assert counts and counts[0] > 100_000, server.log()[-2000:]


def test_reflection_lists_and_describes_the_service(server):
    with grpc.insecure_channel(server.target) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        services = db.get_services()
        assert "tracewire.v1.TraceService" in services
        assert "grpc.health.v1.Health" in services
        from google.protobuf.descriptor_pool import DescriptorPool

        pool = DescriptorPool(db)
        service = pool.FindServiceByName("tracewire.v1.TraceService")
        assert {m.name for m in service.methods} >= {
            "Generate", "GenerateStream", "Trace", "Tokenize", "Detokenize", "GetModelInfo",
        }


def test_deadline_aborts_the_engine_request(server):
    # 500 tokens take ~1.5 s on 2 CPU cores; the deadline is 5x shorter.
    client = tracewire.Client(server.target, timeout=0.3)
    with pytest.raises(tracewire.DeadlineExceeded):
        client.generate("The capital of France is", max_tokens=500, ignore_eos=True,
                        temperature=0.0)
    assert wait_for_unfinished(server.target, lambda n: n == 0), "the engine request outlived its deadline"


def test_client_disconnect_aborts_the_stream(server):
    client = tracewire.Client(server.target, timeout=120)
    stream = client.generate_stream("The capital of France is", max_tokens=500,
                                    ignore_eos=True, temperature=0.0)
    next(stream)
    assert engine_stats(server.target).num_unfinished_requests == 1
    stream.close()  # cancels the call
    assert wait_for_unfinished(server.target, lambda n: n == 0), "the engine request outlived the client"
    client.close()
