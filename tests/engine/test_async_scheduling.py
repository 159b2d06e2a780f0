"""Async scheduling: the next step is planned and started before the one before's tokens
are read, with the tokens, stops, logprobs and prefix-cache hits of the engine that waits."""
from __future__ import annotations

import pytest
import torch

from batchinfer.config import EngineConfig
from batchinfer.engine import engine as engine_module
from batchinfer.engine.engine import LLMEngine
from batchinfer.engine.model_runner import DeferredOutput
from batchinfer.sampling_params import SamplingParams, StructuredOutputsParams


def _run(model, requests, **engine_kwargs):
    engine = LLMEngine.from_kwargs(str(model), seed=0, **engine_kwargs)
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, params)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
    # every request's batch row and runner state freed, or to be with the next plan (those
    # that ended in the last step), also where a request ended while the others' last
    # tokens were on their way (a plan that computes nothing, which tells the runner)
    runner, told_next = engine.model_runner, engine.scheduler.finished_req_ids
    assert set(runner.input_batch.row_of) <= told_next and set(runner.requests) <= told_next
    return engine, [outputs[f"r{i}"] for i in range(len(requests))]


def _view(out):
    return (out.error, out.num_cached_tokens,
            [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in out.outputs])


def _prompts(n: int, shared: int = 0) -> list[list[int]]:
    head = [(11 * j) % 500 + 7 for j in range(shared)]
    return [head + [(7 * i + 3 * j) % 700 + 20 for j in range(3 + 9 * i)] for i in range(n)]


def _compare(model, requests, **engine_kwargs):
    sync_engine, expected = _run(model, requests, **engine_kwargs)
    async_engine, got = _run(model, requests, async_scheduling=True, **engine_kwargs)
    assert [_view(o) for o in got] == [_view(o) for o in expected]
    return sync_engine, async_engine, expected, got


def test_mixed_lengths_length_stops_and_chunked_prefill(llama_dir):
    requests = [(p, SamplingParams(temperature=0, max_tokens=1 + 4 * (i % 5), ignore_eos=True))
                for i, p in enumerate(_prompts(14))]
    _compare(llama_dir, requests, max_num_seqs=6, max_num_batched_tokens=40)


def test_stop_tokens_and_stop_strings_end_requests_a_step_late_and_lose_nothing(llama_dir):
    _, free = _run(llama_dir, [(p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
                                for p in _prompts(8)])
    # stop on tokens and texts the model does produce, at different steps per request
    requests = []
    for i, (p, out) in enumerate(zip(_prompts(8), free)):
        ids, text = out.outputs[0].token_ids, out.outputs[0].text
        if i % 2:
            requests.append((p, SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[ids[2 + i]])))
        else:
            requests.append((p, SamplingParams(temperature=0, max_tokens=24, stop=[text[5 + i:8 + i]])))
    _, _, expected, _ = _compare(llama_dir, requests, max_num_seqs=8)
    assert {o.outputs[0].finish_reason for o in expected} == {"stop"}


def test_requests_ending_one_step_apart(llama_dir):
    """The last plan computes nothing (the last request's last token is on its way) and
    tells the runner of the request that ended just before."""
    prompt = _prompts(2)[1]
    requests = [(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
                for n in (2, 3)]
    _compare(llama_dir, requests)


def test_mixtures_of_experts_and_latent_attention(glm4_moe_dir, deepseek_v3_dir):
    requests = [(p, SamplingParams(temperature=0, max_tokens=3 + 3 * (i % 3), ignore_eos=True))
                for i, p in enumerate(_prompts(6))]
    for model in (glm4_moe_dir, deepseek_v3_dir):
        _compare(model, requests, max_num_seqs=4, max_num_batched_tokens=48)


def test_preemption_in_a_small_pool(llama_dir):
    requests = [(p, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)) for p in _prompts(8)]
    sync_engine, async_engine, _, _ = _compare(llama_dir, requests, num_kv_blocks=14,
                                               max_num_seqs=8, block_size=8)
    assert sync_engine.stats()["num_preemptions"] > 0
    assert async_engine.stats()["num_preemptions"] > 0


def test_prefix_cache_registers_blocks_that_sampled_tokens_fill(llama_dir):
    """A second request whose prompt is the first's prompt and output reads the blocks the
    output filled, registered once their tokens came back."""
    prompt = _prompts(1)[0]
    first = (prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    for async_scheduling in (False, True):
        engine, (out,) = _run(llama_dir, [first], block_size=8,
                              async_scheduling=async_scheduling)
        follow = prompt + out.outputs[0].token_ids + [5]
        engine.add_request("next", follow, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        hits = None
        while engine.has_unfinished_requests():
            for done in engine.step():
                hits = done.num_cached_tokens
        assert hits == (len(follow) - 1) // 8 * 8, async_scheduling


def test_sampling_seeds_logprobs_and_samples_of_one_prompt(llama_dir):
    requests = [(p, SamplingParams(max_tokens=9, temperature=0.8, seed=i, n=2, logprobs=3,
                                   ignore_eos=True))
                for i, p in enumerate(_prompts(5, shared=24))]
    _, _, expected, got = _compare(llama_dir, requests, max_num_seqs=4)
    for a, b in zip(expected, got):
        for x, y in zip(a.outputs, b.outputs):
            assert x.cumulative_logprob == pytest.approx(y.cumulative_logprob, abs=1e-5)


def _order(monkeypatch) -> list[str]:
    log: list[str] = []
    schedule = engine_module.Scheduler.schedule
    result = DeferredOutput.result

    def logged_schedule(self):
        log.append("plan")
        return schedule(self)

    def logged_result(self):
        log.append("tokens")
        return result(self)

    monkeypatch.setattr(engine_module.Scheduler, "schedule", logged_schedule)
    monkeypatch.setattr(DeferredOutput, "result", logged_result)
    return log


def test_the_next_step_is_planned_before_the_last_ones_tokens_are_read(llama_dir, monkeypatch):
    log = _order(monkeypatch)
    _run(llama_dir, [(_prompts(1)[0], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))],
         async_scheduling=True)
    # prefill + 4 decodes, each planned before the step before it is read; the last plan
    # is empty: the request's last token is on its way, and nothing is computed after it
    assert log == ["plan", "plan", "tokens", "plan", "tokens", "plan", "tokens", "plan",
                   "tokens", "plan", "tokens"]


def test_requests_whose_sampling_reads_their_last_token_wait_for_it(llama_dir, monkeypatch):
    """A structured output's mask and a penalty read the token sampled before: with such a
    request unfinished each step is read before the next is planned, and the tokens are
    those of the engine that always waits."""
    prompts = _prompts(4)
    requests = [
        (prompts[0], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)),
        (prompts[1], SamplingParams(temperature=0, max_tokens=6, structured_outputs=StructuredOutputsParams(
            choice=["alpha", "beta gamma"]))),
        (prompts[2], SamplingParams(temperature=0, max_tokens=6, repetition_penalty=1.3, ignore_eos=True)),
        (prompts[3], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)),
    ]
    _compare(llama_dir, requests)
    log = _order(monkeypatch)
    _run(llama_dir, requests, async_scheduling=True)
    assert "plan" in log and all(a != b for a, b in zip(log, log[1:]))  # plan, read, plan, ...


def test_a_structured_output_that_cannot_go_on_ends_in_its_error(llama_dir, monkeypatch):
    """A grammar past llguidance's bound on its lexer states ends its request with that
    error, read with the tokens of its step, and the other requests run on."""
    from batchinfer.structured import grammar
    monkeypatch.setitem(grammar.LIMITS, "max_lexer_states", 20)
    prompts = _prompts(3)
    requests = [(prompts[0], SamplingParams(max_tokens=8, structured_outputs=
                                            StructuredOutputsParams(regex="[a-z]{1,20}z"))),
                (prompts[1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)),
                (prompts[2], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))]
    _, _, expected, got = _compare(llama_dir, requests)
    assert got[0].outputs[0].finish_reason == "error" and "too many states" in got[0].error
    assert [o.outputs[0].finish_reason for o in got[1:]] == ["length", "length"]


def test_async_scheduling_is_refused_with_parallelism():
    for kwargs in ({"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}, {"nnodes": 2}):
        with pytest.raises(ValueError, match="async_scheduling runs one engine process"):
            EngineConfig(model="m", async_scheduling=True, **kwargs)


@pytest.mark.gpu
def test_on_a_gpu_with_cuda_graphs_and_eager_steps(llama_dir):
    """Inputs taken on the device from the step before, replayed in CUDA graphs (decodes)
    and run eagerly (prompt steps): the tokens of the engine that waits. The requests run
    in lockstep (one prompt length, one max_tokens), so both engines' steps have the same
    rows and a GPU's products the same shapes."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    requests = [([(5 * i + 3 * j) % 700 + 20 for j in range(40)],
                 SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
                for i in range(6)]
    for eager in (False, True):
        _compare(llama_dir, requests, device="cuda", max_num_seqs=6, enforce_eager=eager)
