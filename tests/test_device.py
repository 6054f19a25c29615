"""Where an engine runs: --device is checked before any work, and moving an engine's tensors to a
device keeps every tensor that several graphs share as one tensor there."""
import json

import pytest
import torch

from tiny import tiny_model

import specc
from specc.backends import check_device, move_states
from specc.errors import SpeccError


def test_check_device():
    assert check_device("cpu") == "cpu"
    with pytest.raises(SpeccError, match="not a device"):
        check_device("gpu please")
    with pytest.raises(SpeccError, match="cpu or cuda"):
        check_device("meta")
    if not torch.cuda.is_available():
        with pytest.raises(SpeccError, match="needs a CUDA GPU"):
            check_device("cuda")


def test_move_states_keeps_shared_tensors_shared():
    head, cache = torch.randn(4, 3), torch.zeros(2, 5)
    states = {"target": {"w_head": head, "blocks.0.k_cache": cache},
              "mtp": {"w_head": head, "k_cache": torch.zeros(1)},
              "fused": {"w_head": head, "blocks.0.k_cache": cache}}
    assert move_states(states, "cpu") is states
    moved = move_states(states, "meta")  # any device but the CPU takes the same path
    assert moved["target"]["w_head"].device.type == "meta"
    assert moved["target"]["w_head"] is moved["mtp"]["w_head"] is moved["fused"]["w_head"]
    assert moved["target"]["blocks.0.k_cache"] is moved["fused"]["blocks.0.k_cache"]  # one cache, one set of writes
    assert moved["mtp"]["k_cache"] is not moved["target"]["blocks.0.k_cache"]


def test_engine_records_and_loads_its_device(tmp_path):
    model = tiny_model("llama", vocab=64, layers=1, seed=2)
    model.save_pretrained(tmp_path / "m")
    path = specc.compile(tmp_path / "m", drafter="ngram", tree="chain:2", output_dir=tmp_path / "e", max_len=64,
                         prefill_chunk=8, progress=False, modes="greedy", device="cpu")
    engine = specc.load(path, device="cpu")
    assert engine.manifest.device == "cpu" and engine.device == torch.device("cpu")
    assert len(engine.generate([5, 6, 7, 5, 6], max_new_tokens=6, stop_at_eos=False).token_ids) == 6
    if not torch.cuda.is_available():
        with pytest.raises(SpeccError, match="needs a CUDA GPU"):
            specc.load(path, device="cuda")


def test_on_device_moves_a_copy():
    """move_to_device_pass works in place; the engine still needs the CPU program afterwards (the
    fused step is built from the lowered step and drafter programs), so on_device moves a copy."""
    from specc.backends import on_device
    from specc.pipeline import capture
    from specc.target_module import TargetModule, causal_mask

    tm = TargetModule(tiny_model("llama", vocab=64, layers=1, seed=2), 16)
    T = 2
    ep = capture(tm, (torch.zeros(1, T, dtype=torch.int64), torch.arange(T).view(1, T), torch.arange(T),
                      causal_mask(T, 0, 16)))
    assert on_device(ep, "cpu") is ep
    moved = on_device(ep, "meta")  # any device but the CPU takes the same path
    assert moved is not ep
    assert all(t.device.type == "meta" for t in moved.state_dict.values())
    assert all(t.device.type == "cpu" for t in ep.state_dict.values())


def test_cuda_graphs_are_skipped_off_cuda(tmp_path):
    """On the CPU, asking for CUDA graphs (the default) captures nothing: the path is skipped, not faked."""
    model = tiny_model("llama", vocab=64, layers=1, seed=2)
    model.save_pretrained(tmp_path / "m")
    path = specc.compile(tmp_path / "m", drafter="ngram", tree="chain:2", output_dir=tmp_path / "e", max_len=64,
                         prefill_chunk=8, progress=False, modes="greedy")
    engine = specc.load(path, device="cpu", cuda_graphs=True)
    assert engine.cuda_graphs is False
    engine.generate([5, 6, 7, 5, 6], max_new_tokens=4, stop_at_eos=False)
    assert engine._captured == {}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graphs)")
@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_cuda_graphs_replay_gives_the_launched_tokens(tmp_path, backend):
    """Decode calls replayed from captured CUDA graphs give the tokens of the same engine launching
    kernel by kernel: plain, unfused and fused, greedy and sampling."""
    from test_engine import mtp_checkpoint

    model = tiny_model("llama", vocab=64, layers=1, seed=3)
    model.save_pretrained(tmp_path / "m")
    path = specc.compile(tmp_path / "m", drafter="mtp", drafter_path=mtp_checkpoint(model, tmp_path / "mtp", "copy")[0],
                         tree="topk:2,2", children="sampled", backend=backend, device="cuda",
                         output_dir=tmp_path / "e", max_len=64, prefill_chunk=8, progress=False, modes="greedy,top_p")
    replayed, launched = specc.load(path, cuda_graphs=True), specc.load(path, cuda_graphs=False)
    prompt = [5, 6, 7, 5, 6, 9, 10]
    for kw in (dict(), dict(temperature=0.8, top_p=0.9, seed=4)):
        for fused, speculate in ((True, True), (False, True), (True, False)):
            replayed.use_fused = launched.use_fused = fused
            a = replayed.generate(prompt, max_new_tokens=24, stop_at_eos=False, speculate=speculate, **kw)
            b = launched.generate(prompt, max_new_tokens=24, stop_at_eos=False, speculate=speculate, **kw)
            assert a.token_ids == b.token_ids and a.stats.steps == b.stats.steps
    assert {"plain_greedy", "step_greedy", "fused_greedy", "fused_top_p"} <= set(replayed._captured)


def _cpu_peak(fn):
    """fn's result and the most CPU memory its allocations held at once (torch's allocator, read
    through the profiler's memory events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = sorted((e for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU),
                    key=lambda e: e.start_ns())
    held = peak = 0
    for e in events:
        held += e.nbytes()
        peak = max(peak, held)
    return out, peak


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage()._cdata == b.untyped_storage()._cdata


def _moved_programs(monkeypatch):
    """Wrap on_device: every program it returns, with the engine tensors it was given and the CPU
    memory its call held at most."""
    import specc.backends as backends

    calls, inner = [], backends.on_device

    def recording(ep, device, state=None):
        moved, peak = _cpu_peak(lambda: inner(ep, device, state))
        calls.append((moved, state, peak, ep))
        return moved

    monkeypatch.setattr(backends, "on_device", recording)
    return calls


def _check_shared(calls, weight_bytes: int, device: str = "meta"):
    from specc.pipeline import canonical_name

    assert len(calls) >= 3  # an engine of several graphs, every one moved
    for moved, state, peak, _ in calls:
        assert peak < weight_bytes / 20, (peak, weight_bytes)  # no CPU copy of the weights
        owned = 0
        for fqn, t in (*moved.state_dict.items(), *moved.constants.items()):
            assert t.device.type == device
            if canonical_name(fqn) in state:  # the engine's own tensor, never a copy of it
                assert _shares(t, state[canonical_name(fqn)]), fqn
                owned += 1
        assert owned >= 3


def test_graphs_for_a_device_share_the_engine_weights(tmp_path, monkeypatch):
    """Issue 47: compiling an engine of N graphs for a device (inductor) and opening an eager engine's
    graphs there hold one set of the engine's weights on that device, moved once (move_states), and
    no second copy anywhere. No GPU here: 'meta' stands in for it (its tensors have no data, so a copy
    to it shows as a new storage, and a copy through the CPU as CPU memory), with deliberately large
    embedding and head tables."""
    import copy

    import specc.backends as backends
    import specc.compiler as compiler
    import specc.config as config
    from torch.export.passes import move_to_device_pass

    model = tiny_model("llama", vocab=16384, layers=1, hidden=128, seed=2)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert weight_bytes > 16e6
    model.save_pretrained(tmp_path / "m")
    monkeypatch.setattr(config, "check_device", lambda d: d)  # let 'meta' through
    monkeypatch.setattr(compiler, "check_device", lambda d: d)
    calls = _moved_programs(monkeypatch)
    compiled = []

    def fake_compile(ep, state, out_path, example_args, passes=()):  # what AOTInductor would be given
        compiled.append(ep)
        out_path.write_bytes(b"")
        return list(state)

    monkeypatch.setattr(backends, "compile_inductor", fake_compile)
    options = dict(drafter="ngram", tree="chain:2", max_len=64, prefill_chunk=8, progress=False, modes="greedy")
    specc.compile(tmp_path / "m", backend="inductor", device="meta", output_dir=tmp_path / "ind", **options)
    assert len(compiled) == len(calls) and all(ep is c[0] for ep, c in zip(compiled, calls))
    _check_shared(calls, weight_bytes)

    # the measure sees a copy: what on_device did before (a deep copy of the program, then moved)
    _, old_peak = _cpu_peak(lambda: move_to_device_pass(copy.deepcopy(calls[0][3]), "meta"))
    assert old_peak > weight_bytes * 0.9

    # eager: the saved graphs opened on the device bind the engine's tensors there
    done = []
    path = specc.compile(tmp_path / "m", backend="eager", output_dir=tmp_path / "eager",
                         on_graph=lambda name, s: done.append(name), **options)
    manifest = json.loads((path / "specc.json").read_text())
    assert done == list(manifest["graphs"]) == list(manifest["compile_s"])  # each graph reported as it was done
    calls.clear()
    specc.load(path, device="meta", cuda_graphs=False)
    _check_shared(calls, weight_bytes)
