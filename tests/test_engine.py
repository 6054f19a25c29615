"""End to end on tiny random models: compile -> artifact -> load -> generate, against HF generate()."""
import json
from pathlib import Path

import pytest
import torch

import specc
from specc.errors import SpeccError
from tiny import tiny_model

PROMPT = [5, 6, 7, 8, 5, 6, 7, 9, 10, 11, 12, 5, 6]


def hf_greedy(model, ids, n):
    """The target alone: HF forward over the whole sequence, argmax, append (EOS does not stop it)."""
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids):]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine")
    model = tiny_model("llama", vocab=64, layers=2, seed=0)
    model.save_pretrained(root / "llama")
    tiny_model("llama", vocab=64, layers=1, seed=5).save_pretrained(root / "draft")
    return root, model


# Every architecture through an ngram engine, speculative and plain (its plain graph); a plain-only
# engine and the draft model (the target's first layer) on two architectures, one with q/k norms.
@pytest.mark.parametrize("arch,drafter,tree", [(a, "ngram", "chain:3") for a in ("llama", "qwen2", "qwen3", "mistral")]
                         + [("llama", "none", None)]
                         + [(a, "draft-model", "chain:2") for a in ("llama", "qwen3")])
def test_greedy_identical_to_hf(tmp_path, arch, drafter, tree):
    model = tiny_model(arch, vocab=64, layers=2, seed=1)
    model.save_pretrained(tmp_path / "m")
    kw = {"drafter_layers": 1} if drafter == "draft-model" else {}
    engine = specc.load(specc.compile(tmp_path / "m", drafter=drafter, tree=tree, output_dir=tmp_path / "e",
                                      max_len=64, prefill_chunk=8, progress=False, modes="greedy", **kw))
    res = engine.generate(PROMPT, max_new_tokens=30, stop_at_eos=False)
    expected = hf_greedy(model, PROMPT, 30)
    assert res.token_ids == expected
    assert res.stats.new_tokens == 30
    assert res.stats.steps == 29 if drafter == "none" else res.stats.steps <= 29
    if drafter == "ngram":
        plain = engine.generate(PROMPT, max_new_tokens=30, stop_at_eos=False, speculate=False)
        assert plain.token_ids == expected and plain.stats.steps == 29


def test_separate_draft_model(llama_dir, tmp_path, monkeypatch):
    """A draft model of its own; its eager engine loads its saved programs (no capture on load)."""
    root, model = llama_dir
    path = specc.compile(root / "llama", drafter="draft-model", drafter_path=root / "draft", tree="chain:4",
                         output_dir=tmp_path / "e", max_len=64, prefill_chunk=8, progress=False, modes="greedy")
    manifest = json.loads((path / "specc.json").read_text())
    assert "draft/model.safetensors" in manifest["files"]
    for name, g in manifest["graphs"].items():
        assert g["file"] == f"graphs/{name}.json" and g["file"] in manifest["files"]

    def no_capture(*a, **k):
        raise AssertionError("load captured a program again")

    monkeypatch.setattr(torch.export, "export", no_capture)
    res = specc.load(path).generate(PROMPT, max_new_tokens=25, stop_at_eos=False)
    assert res.token_ids == hf_greedy(model, PROMPT, 25)


def test_inductor_matches_eager_and_caches(llama_dir, tmp_path, monkeypatch, capsys):
    """AOTInductor engine: same tokens as HF (greedy) and as the eager engine (sampling, same seed);
    compiling the same model again reuses the compile cache (no AOTInductor compile at all). A
    draft model, so that its graphs go through Inductor too (the SmolLM2 tests run it eager)."""
    root, model = llama_dir
    kw = dict(drafter="draft-model", drafter_path=root / "draft", tree="chain:3", max_len=64, prefill_chunk=8,
              progress=False, modes="greedy,top_p")
    ind = specc.compile(root / "llama", backend="inductor", output_dir=tmp_path / "ind", **kw)
    calls = []
    real = torch._inductor.aoti_compile_and_package
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", lambda *a, **k: calls.append(1) or real(*a, **k))
    again = specc.compile(root / "llama", backend="inductor", output_dir=tmp_path / "ind2", **kw)
    assert calls == []
    # the manifest says where the time went: every graph, and here every package from the compile cache
    split = json.loads((again / "specc.json").read_text())["compile_split"]
    graphs = json.loads((again / "specc.json").read_text())["graphs"]
    assert set(split["graphs"]) == set(graphs) and split["cache_hits"] == len(graphs)
    assert {"load", "capture", "lift", "lower", "save"} <= set(split["phases"]) and "cpp_build" not in split["phases"]
    assert sum(split["phases"].values()) <= split["total_s"] + 0.1
    names = ["draft_prefill", "draft_step"] + [f"{g}_{m}" for g in ("plain", "prefill", "step")
                                               for m in ("greedy", "top_p")]
    for name in names:
        assert (ind / "graphs" / f"{name}.pt2").read_bytes() == (again / "graphs" / f"{name}.pt2").read_bytes()
    assert sorted(p.name for p in (ind / "graphs").iterdir()) == sorted(f"{n}.pt2" for n in names)
    engine = specc.load(ind)
    assert engine.generate(PROMPT, max_new_tokens=30, stop_at_eos=False).token_ids == hf_greedy(model, PROMPT, 30)
    # float32 on CPU: the few-row products are the C++ product (built here), which load must find
    from specc.kernels import cpu_kernels

    assert json.loads((ind / "specc.json").read_text())["cpu_kernels"] is True
    from specc.cli import main as cli_main

    assert cli_main(["inspect", str(ind)]) == 0 and "C++ CPU products" in capsys.readouterr().out
    monkeypatch.setitem(cpu_kernels._state, "loaded", False)
    with pytest.raises(SpeccError, match="C\\+\\+ CPU products, which could not be built here"):
        specc.load(ind)
    monkeypatch.setitem(cpu_kernels._state, "loaded", True)
    eager = specc.load(specc.compile(root / "llama", backend="eager", output_dir=tmp_path / "eager", **kw))
    for seed in range(3):
        a = engine.generate(PROMPT, max_new_tokens=20, temperature=0.9, top_p=0.9, seed=seed, stop_at_eos=False)
        b = eager.generate(PROMPT, max_new_tokens=20, temperature=0.9, top_p=0.9, seed=seed, stop_at_eos=False)
        assert a.token_ids == b.token_ids


def test_stops_and_stream(llama_dir, tmp_path):
    root, model = llama_dir
    engine = specc.load(specc.compile(root / "llama", drafter="ngram", tree="chain:3", output_dir=tmp_path / "e",
                                      max_len=24, prefill_chunk=8, progress=False, modes="greedy"))
    res = engine.generate(PROMPT, max_new_tokens=100, stop_at_eos=False)
    assert res.stats.stop == "max_len" and len(PROMPT) + res.stats.new_tokens == 24
    full = engine.generate(PROMPT, max_new_tokens=8, stop_at_eos=False)
    eos = full.token_ids[3]
    engine.eos = {eos}
    cut = engine.generate(PROMPT, max_new_tokens=8)
    assert cut.token_ids == full.token_ids[: full.token_ids.index(eos) + 1] and cut.stats.stop == "eos"
    with pytest.raises(SpeccError, match="does not fit --max-len"):
        engine.generate(list(range(2, 30)), max_new_tokens=4)


def test_load_validates(llama_dir, tmp_path):
    root, _ = llama_dir
    path = specc.compile(root / "llama", drafter="none", output_dir=tmp_path / "e", max_len=32, prefill_chunk=8,
                         progress=False, modes="greedy")
    engine = specc.load(path)
    with pytest.raises(SpeccError, match="expected"):  # compiled graphs get exactly their static shapes
        engine.graphs["plain_greedy"](torch.zeros(3, dtype=torch.int64), torch.tensor(0))
    manifest = json.loads((path / "specc.json").read_text())
    manifest["format_version"] = 99
    (path / "specc.json").write_text(json.dumps(manifest))
    with pytest.raises(SpeccError, match="format"):
        specc.load(path)
    assert not list(path.rglob("*.bin")) and not list(path.rglob("*.pt"))  # no pickles in an engine


def test_prefill_every_tail_length(llama_dir, tmp_path):
    """Prompts of every length around the chunk size: whole chunks, padded chunks, and short tails
    that go through the one-token graph, for the target and the draft model alike."""
    root, model = llama_dir
    engine = specc.load(specc.compile(root / "llama", drafter="draft-model", drafter_layers=1, tree="chain:2",
                                      output_dir=tmp_path / "e", max_len=48, prefill_chunk=4, progress=False,
                                      modes="greedy"))
    calls = []
    plain = engine.graphs["plain_greedy"]
    engine.graphs["plain_greedy"] = lambda *a: calls.append(int(a[1])) or plain(*a)
    for n in range(1, 11):
        ids = (PROMPT * 2)[:n]
        calls.clear()
        assert engine.generate(ids, max_new_tokens=6, stop_at_eos=False).token_ids == hf_greedy(model, ids, 6)
        # the tail (n % 4 of up to 3 tokens) went through the one-token graph, at its own positions
        assert [c for c in calls if c < n] == list(range(n - n % 4, n)), n


def test_prefill_chunks_of_several_sizes(llama_dir, tmp_path, capsys):
    """--prefill-chunk 8,4: a chunk graph per size, each timed at compile with the one-token graph
    (manifest prefill_ms; `specc inspect` shows them), a size past --max-len dropped; prompts of every
    length up to three large chunks give HF's tokens whatever mix of calls covers them, and the calls
    are the plan's (largest chunks first, a padded chunk only last)."""
    from specc.cli import main as cli_main
    from specc.prefill import prefill_plan

    root, model = llama_dir
    path = specc.compile(root / "llama", drafter="ngram", tree="chain:2", output_dir=tmp_path / "e", max_len=48,
                         prefill_chunk="64,8,4", progress=False, modes="greedy")
    m = json.loads((path / "specc.json").read_text())
    assert (m["prefill_chunk"], m["prefill_chunks"], m["cache_len"]) == (4, [8, 4], 48 + 4)
    assert {"prefill_greedy", "prefill8_greedy"} <= set(m["graphs"]) and "prefill64_greedy" not in m["graphs"]
    assert sorted(m["prefill_ms"]) == ["1", "4", "8"] and all(v > 0 for v in m["prefill_ms"].values())
    assert cli_main(["inspect", str(path)]) == 0
    assert "prefill chunks 8, 4 (ms a call: 1 token" in capsys.readouterr().out
    engine = specc.load(path)
    costs = {int(k): v for k, v in m["prefill_ms"].items()}
    sizes = []
    for name in ("prefill_greedy", "prefill8_greedy", "plain_greedy"):
        graph = engine.graphs[name]
        engine.graphs[name] = lambda *a, graph=graph, name=name: sizes.append((name, int(a[0].numel()))) or graph(*a)
    for n in list(range(1, 25)) + [45, 47]:  # near --max-len: no padded 8-chunk past the cache's 52 slots
        ids = (PROMPT * 4)[:n]
        sizes.clear()
        new = min(4, 48 - n)  # up to --max-len
        assert engine.generate(ids, max_new_tokens=new, speculate=False, stop_at_eos=False).token_ids == \
            hf_greedy(model, ids, new), n
        plan = prefill_plan(n, costs, m["cache_len"])
        assert [size for _, size in sizes[: len(plan)]] == [size for _, size in plan], n
        assert all(start + size <= m["cache_len"] for start, size in plan)


def test_prefill_plan_is_the_cheapest_cover():
    """prefill_plan against brute force over every sequence of calls (each call starts where the last
    ended; all but the last end inside the prompt; none ends past the capacity): the least total cost,
    contiguous from token 0 to the prompt's end. Without measured costs, the old rule."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from specc.prefill import estimated_costs, prefill_plan

    def cheapest(n, costs, capacity):
        def cost_from(i):  # every sequence of calls from token i on, enumerated
            options = [costs[size] + (0.0 if i + size >= n else cost_from(i + size))
                       for size in costs if capacity is None or i + size <= capacity]
            return min(options, default=float("inf"))
        return cost_from(0)

    @settings(max_examples=150, deadline=None)
    @given(st.integers(1, 14), st.lists(st.integers(2, 9), min_size=0, max_size=2, unique=True),
           st.lists(st.floats(0.5, 100.0), min_size=3, max_size=3), st.integers(0, 9))
    def check(n, chunks, ms, room):
        costs = {1: ms[0], **{c: ms[i + 1] for i, c in enumerate(chunks)}}
        capacity = n + room
        plan = prefill_plan(n, costs, capacity)
        assert plan[0][0] == 0 and all(s1 + z1 == s2 for (s1, z1), (s2, _) in zip(plan, plan[1:]))
        assert plan[-1][0] + plan[-1][1] >= n and all(s + z < n for s, z in plan[:-1])
        assert all(s + z <= capacity for s, z in plan)
        assert sum(costs[z] for _, z in plan) == pytest.approx(cheapest(n, costs, capacity))

    check()
    # the capacity decides: the cheap 8-chunk may not pad past slot 47 (from 40 it would end at 48)
    assert prefill_plan(43, {1: 10.0, 4: 10.0, 8: 1.0}, 48) == [(0, 8), (8, 8), (16, 8), (24, 8), (32, 8), (40, 8)]
    assert prefill_plan(43, {1: 10.0, 4: 10.0, 8: 1.0}, 47) == [(0, 8), (8, 8), (16, 8), (24, 8), (32, 8), (40, 4)]
    # no measured costs: a tail of up to 3 tokens through the one-token graph, whole chunks largest first
    for chunk in (4, 8, 32, 128):
        assert prefill_plan(chunk + 3, estimated_costs([chunk])) == [(0, chunk)] + [(chunk + i, 1) for i in range(3)]
        assert prefill_plan(chunk + 4, estimated_costs([chunk])) == [(0, chunk), (chunk, chunk)]
    assert prefill_plan(200, estimated_costs([128, 32])) == [(0, 128), (128, 32), (160, 32), (192, 32)]
    assert prefill_plan(145, {1: 16.0, 32: 97.0, 128: 258.0}) == [(0, 128), (128, 32)]


def test_compile_cache_key_sees_the_tree(llama_dir):
    """Two trees of the same size must never share a cached package; the same tree must."""
    from specc.backends import cache_key, lift
    from specc.drafters import get_kind
    from specc.plans import build_program, graph_plans
    from specc.target_module import TargetModule, module_state
    from specc.pipeline import example_inputs
    from specc.tree import tree_from_paths

    _, model = llama_dir
    tm = TargetModule(model, 40)

    def key(paths):
        tree = tree_from_paths(paths)
        plan = [p for p in graph_plans(get_kind("ngram"), tree, 8, 40) if p.name == "step_greedy"][0]
        ep = build_program(plan, {"target": tm}, {}, tree)
        args = example_inputs(ep)
        lifted, sub = lift(ep, module_state(tm), args)
        return cache_key(lifted, sub, args)

    a = key([[0], [1], [0, 0]])
    assert a == key([[0], [1], [0, 0]])
    assert a != key([[0], [1], [1, 0]])


def test_compile_cache_key_ignores_comments_not_code(tmp_path):
    """The kernels' code keys the compile cache; their comments and docstrings do not, so a
    documentation edit keeps every compiled graph. Comment-like text inside a literal is code."""
    import specc.kernels
    from specc.backends import code_text, kernel_sources

    def text(name, source):
        (tmp_path / name).write_text(source)
        return code_text(tmp_path / name)

    py = '"""Module."""\nclass C:\n    """Class."""\n    def f(self, x):\n        """Doc."""\n        "kept"\n' \
         '        return f"{x + 1}"  # one\n'
    same = '# a header\nclass C:\n\n    def f(self, x):\n        \'\'\'Other.\'\'\'\n        "kept"\n        return f"{x + 1}"\n'
    assert text("a.py", py) == text("b.py", same)
    for old, new in (("x + 1", "x + 2"), ('"kept"', '"other"'), ('"""Doc."""', 's = "Doc."')):
        assert text("a.py", py) != text("b.py", py.replace(old, new)), new
    cpp = 'int f() {  // one\n  /* two\n  lines */\n  return 1;\n}\nconst char* s = "a // b";\nchar q = \'"\';\n'
    assert text("a.cpp", cpp) == text("b.cpp", 'int f() {\n\n  return 1; /* other */\n}\n'
                                               'const char* s = "a // b";\nchar q = \'"\'; // "\n')
    for old, new in (("return 1", "return 2"), ('"a // b"', '"a // c"'), ("'\"'", "'/'"),
                     ("// one\n", "// one \\\n")):  # the continued comment swallows the next line
        assert text("a.cpp", cpp) != text("b.cpp", cpp.replace(old, new)), new
    raw = 'const char* r = R"(a " /* )";\nint g() { return 1; } /* */\n'
    assert text("r.cpp", raw) == raw  # a raw string: every byte counts
    # a real kernel: the same code with every comment line dropped, and its code in the key
    src = Path(specc.kernels.__file__).parent / "rows_linear.py"
    lines = src.read_text().splitlines()
    bare = [line for line in lines if not line.lstrip().startswith("#")]
    assert len(bare) < len(lines) and code_text(src) == text("rows_linear.py", "\n".join(bare))
    assert code_text(src) in kernel_sources()


def test_one_compile_per_graph_at_a_time(tmp_path, monkeypatch):
    """While another process compiles a graph (it holds the graph's lock), a compile of the same
    graph waits, then takes that package from the cache instead of compiling it again."""
    import fcntl
    import threading

    from specc import backends

    monkeypatch.setenv("SPECC_CACHE", str(tmp_path / "cache"))
    lin = torch.nn.Linear(4, 4)
    args = (torch.zeros(1, 4),)
    ep = torch.export.export(lin, args)
    state = {"weight": lin.weight.detach(), "bias": lin.bias.detach()}
    compiles = []
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", lambda *a, **k: compiles.append(1))
    cached = tmp_path / "cache" / "aoti" / f"{backends.cache_key(*backends.lift(ep, state, args), args)}.pt2"
    cached.parent.mkdir(parents=True)
    with open(cached.with_suffix(".lock"), "w") as other:  # the other process's compile
        fcntl.flock(other, fcntl.LOCK_EX)
        waiter = threading.Thread(target=backends.compile_inductor, args=(ep, state, tmp_path / "g.pt2", args))
        waiter.start()
        waiter.join(timeout=3)
        assert waiter.is_alive() and not compiles  # waiting, not compiling
        cached.write_bytes(b"the other process's package")
    waiter.join()
    assert not compiles and (tmp_path / "g.pt2").read_bytes() == b"the other process's package"


def random_dflash(target, path, block=4, layers=1, seed=0):
    from specc.drafters.dflash.model import DFlashDrafter, dflash_config_for, save_dflash

    torch.manual_seed(seed)
    d = DFlashDrafter(dflash_config_for(target.config, num_layers=layers, block_size=block, num_taps=2,
                                        mask_token_id=3))
    with torch.no_grad():
        for p in d.parameters():
            p.copy_(torch.randn_like(p) * 0.3 if p.dim() > 1 else 1 + 0.1 * torch.randn_like(p))
    return save_dflash(d, path), d


# Inductor DFlash engines: test_tree_engine.py::test_fused_step_equals_unfused (fused and unfused paths).
@pytest.mark.parametrize("arch,backend", [("llama", "eager"), ("qwen3", "eager")])
def test_dflash_engine_greedy_and_context_rows(tmp_path, arch, backend):
    """Greedy output equals the target's; every block the engine drafts equals the teacher-forced
    reference forward over the committed tokens (so the context rows, positions and anchor that
    the runtime feeds the drafter's cache are the right ones)."""
    from specc.drafters.dflash.model import draft_logits

    model = tiny_model(arch, vocab=64, layers=3, seed=2)
    model.save_pretrained(tmp_path / "m")
    dpath, d = random_dflash(model, tmp_path / "dflash", block=4)
    engine = specc.load(specc.compile(tmp_path / "m", drafter="dflash", drafter_path=dpath, tree="chain:3",
                                      backend=backend, output_dir=tmp_path / "e", max_len=64, prefill_chunk=8,
                                      progress=False, modes="greedy"))
    seen = []
    engine.use_fused = False  # every step through the drafter's graph; tests/test_tree_engine.py checks the fused step
    real = engine.drafter.propose
    engine.drafter.propose = record(real, seen)
    for prompt in (PROMPT, PROMPT[:3], PROMPT * 2):
        res = engine.generate(prompt, max_new_tokens=20, stop_at_eos=False)
        assert res.token_ids == hf_greedy(model, prompt, 20)
    assert len(seen) > 20
    with torch.no_grad():
        for committed, (drafts, _) in seen:
            hs = model(torch.tensor([committed]), output_hidden_states=True).hidden_states
            taps = torch.cat([hs[i + 1][0] for i in d.config.target_layer_ids], dim=-1)
            ref = draft_logits(d, model.model.embed_tokens, model.lm_head.weight, taps, torch.tensor(committed),
                               torch.tensor([len(committed) - 1]))[0].argmax(-1)
            assert drafts == ref.tolist()


def test_dflash_refusals(llama_dir, tmp_path):
    root, model = llama_dir
    dpath, _ = random_dflash(model, tmp_path / "dflash", block=4)
    with pytest.raises(SpeccError, match="--drafter-path"):
        specc.compile(root / "llama", drafter="dflash", output_dir=tmp_path / "e1", progress=False)
    with pytest.raises(SpeccError, match="block of 4 gives 3"):
        specc.compile(root / "llama", drafter="dflash", drafter_path=dpath, tree="chain:5",
                      output_dir=tmp_path / "e2", progress=False)
    with pytest.raises(SpeccError, match="--block-size 5 is out of range"):
        specc.compile(root / "llama", drafter="dflash", drafter_path=dpath, block_size=5, tree="chain:3",
                      output_dir=tmp_path / "e4", progress=False)
    with pytest.raises(SpeccError, match="--block-size only applies"):
        specc.compile(root / "llama", drafter="ngram", block_size=3, output_dir=tmp_path / "e5", progress=False)
    other = tiny_model("llama", vocab=64, layers=4, seed=3)
    opath, _ = random_dflash(other, tmp_path / "other", block=4)
    with pytest.raises(SpeccError, match="4-layer model, but the target has 2 layers"):
        specc.compile(root / "llama", drafter="dflash", drafter_path=opath, tree="chain:3",
                      output_dir=tmp_path / "e3", progress=False)
    assert not any((tmp_path / f"e{i}").exists() for i in range(1, 6))


def record(propose, seen: list):
    """A drafter's propose that also appends (committed, (drafts as a list, found)) to `seen`."""
    def call(committed):
        drafts, found = propose(committed)
        seen.append((list(committed), (drafts.tolist() if isinstance(drafts, torch.Tensor) else drafts, found)))
        return drafts, found
    return call


def mtp_checkpoint(target, path, kind: str, seed: int = 0):
    """(checkpoint dir, heads) for an engine test.

    copy: heads that imitate a one-layer target with unit-RMS embedding rows (eh_proj passes the
    embedding through, the layer is the target's), so most drafts are accepted and every
    acceptance length occurs; DeepSeek-V3 layout.
    normed: random heads with their own final norm fed back (Qwen3-Next style) and the MiMo concat
    order, in the Qwen3-Next layout: the engine must carry both settings through its own copy."""
    from specc.drafters.mtp.model import build_heads, save_deepseek_v3, save_qwen3_next

    torch.manual_seed(seed)
    if kind == "copy":
        heads = build_heads(target, depth=2)  # trained for 2; the engine uses its tree's depth
        m, H = heads.mtp[0], target.config.hidden_size
        with torch.no_grad():
            m.layer.load_state_dict(target.model.layers[0].state_dict())
            m.eh_proj.weight.zero_()
            m.eh_proj.weight[:, :H] = torch.eye(H)
        return save_deepseek_v3(heads, path, target), heads.eval()
    heads = build_heads(target, has_final_norm=True, feedback="normed", order="hidden_emb")
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(1.0, 0.3) if p.dim() == 1 else p.normal_(0, 0.2)
    return save_qwen3_next(heads, path, target), heads.eval()


@pytest.mark.parametrize("arch,backend,tree,kind", [
    ("llama", "eager", "chain:1", "copy"), ("llama", "eager", "chain:3", "copy"),
    ("qwen3", "eager", "chain:3", "normed"),
    ("llama", "inductor", "chain:3", "copy")])
def test_mtp_engine_greedy_and_drafts(tmp_path, arch, backend, tree, kind):
    """Greedy output equals the target's; every chain the engine drafts equals the slow uncached
    reference of the cached scheme (so the hidden rows, their next tokens, positions and the
    recursion that the runtime and MTPStep feed the cache are the right ones)."""
    from safetensors import safe_open

    from specc.drafters.mtp.model import MTP_FILE, cached_scheme_drafts

    model = tiny_model(arch, vocab=64, layers=1 if kind == "copy" else 2, seed=2)
    with torch.no_grad():
        w = model.model.embed_tokens.weight
        w /= w.pow(2).mean(-1, keepdim=True).sqrt()  # unit RMS: enorm(emb) is emb itself
        model.model.norm.weight.normal_(1.0, 0.3)  # the head norm and the feedback norm differ
    model.save_pretrained(tmp_path / "m")
    dpath, heads = mtp_checkpoint(model, tmp_path / "mtp", kind)
    path = specc.compile(tmp_path / "m", drafter="mtp", drafter_path=dpath, tree=tree, backend=backend,
                         output_dir=tmp_path / "e", max_len=64, prefill_chunk=8, progress=False, modes="greedy")
    k = int(tree.split(":")[1])
    entry = json.loads((path / "specc.json").read_text())["drafter"]
    assert entry == {"kind": "mtp", "depth": k, "trained_depth": heads.config.depth, "num_modules": 1,
                     "order": heads.config.order, "feedback": heads.config.feedback,
                     "has_final_norm": heads.config.has_final_norm, "children": "topk"}
    with safe_open(str(path / "draft" / MTP_FILE), "pt") as st:  # the engine keeps no head or embedding copy
        assert not any("shared_head.head" in key or "embed_tokens" in key for key in st.keys())
    engine = specc.load(path)
    seen = []
    engine.use_fused = False  # every step through the drafter's graph; tests/test_tree_engine.py checks the fused step
    real = engine.drafter.propose
    engine.drafter.propose = record(real, seen)
    accepted = 0
    for prompt in (PROMPT, PROMPT[:1], PROMPT * 2):
        res = engine.generate(prompt, max_new_tokens=20, stop_at_eos=False)
        assert res.token_ids == hf_greedy(model, prompt, 20)
        accepted += sum(n * c for n, c in enumerate(res.stats.accepted_hist))
    assert len(seen) > 10
    if kind == "copy":
        assert accepted >= 10  # the acceptance paths (several hidden rows per step) really ran
    for committed, (drafts, _) in seen:
        assert drafts == cached_scheme_drafts(heads, model, committed, k)


def test_prefill_and_breakdown_scripts(tmp_path):
    """examples/bench_prefill.py (several chunk sizes against the smallest alone) and
    examples/loop_breakdown.py (the loop's split) on a tiny engine with a chat template: their JSON
    runs hold what they report; an engine with one chunk size is refused in one sentence."""
    import subprocess
    import sys
    from pathlib import Path

    from conftest import cli_env, save_tiny_model, tiny_tokenizer

    model = save_tiny_model(tmp_path / "m", tokenizer=False)
    tok = tiny_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok.save_pretrained(model)
    kw = dict(drafter="ngram", tree="chain:2", backend="eager", max_len=400, progress=False, modes="greedy")
    several = specc.compile(model, output_dir=tmp_path / "e", prefill_chunk="32,8", **kw)
    one = specc.compile(model, output_dir=tmp_path / "one", prefill_chunk=8, **kw)
    examples = Path(__file__).resolve().parents[1] / "examples"

    def run(script, *args):
        return subprocess.run([sys.executable, "-P", str(examples / script), *map(str, args)], env=cli_env(),
                              capture_output=True, text=True, timeout=300)

    out = run("bench_prefill.py", several, "--datasets", "humaneval", "--limit", "2", "--rounds", "1", "--json")
    assert out.returncode == 0, out.stderr
    row, = json.loads(out.stdout)["prefill"]
    assert row["dataset"] == "humaneval" and row["prompts"] == 2 and row["speedup"] > 0
    assert row["calls"]["several sizes"] <= row["calls"]["8 alone"]
    out = run("loop_breakdown.py", several, "--datasets", "mt-bench", "--limit", "1", "--rounds", "1",
              "--max-new-tokens", "6", "--json")
    assert out.returncode == 0, out.stderr
    ds, = json.loads(out.stdout)["breakdown"]
    assert ds["dataset"] == "mt-bench" and ds["speedup"] > 0
    plain, spec = ds["methods"]["plain"], ds["methods"]["speculative"]
    assert plain["parts_s"]["prefill"] > 0 and spec["parts_s"]["prefill"] > 0
    assert plain["graphs"]["plain_greedy"]["c"] == 1.0 and plain["tokens"] == spec["tokens"] == 6
    bad = run("bench_prefill.py", one, "--limit", "1")
    assert bad.returncode == 2 and "one prefill chunk size" in bad.stderr and "Traceback" not in bad.stderr
    out = run("ngram_tau.py", several, "--limit", "1", "--max-new-tokens", "6", "--ks", "2", "--min-ngrams", "1",
              "--trees", "chain:1,topk:1,2")
    assert out.returncode == 0, out.stderr
    rows = [line.split(" | ") for line in out.stdout.splitlines() if line.startswith("| mt-bench | ")]
    assert [(r[1], r[2]) for r in rows if r[1] != "chain:2"] == [("chain:1", "2"), ("topk:1,2", "3")]
    for r in rows:
        if r[1] != "chain:2":  # tokens a step: at least the bonus, at most depth + 1 (2 for both trees)
            assert 1 <= float(r[3]) <= 2
    bad = run("ngram_tau.py", several, "--trees", "chain:x")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


def test_ngram_tau_counts_what_greedy_verification_commits():
    """examples/ngram_tau.py's one-step replay against brute force: the deepest node whose path
    matches the text, plus one (siblings distinct, as verification takes the first match)."""
    import importlib.util
    import random

    from specc.tree import parse_tree, tree_from_paths

    path = Path(__file__).resolve().parents[1] / "examples" / "ngram_tau.py"
    spec = importlib.util.spec_from_file_location("ngram_tau", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.split_trees("chain:1,topk:1,2,topk:2,2") == ["chain:1", "topk:1,2", "topk:2,2"]
    rng = random.Random(0)
    for tree in (parse_tree("chain:3"), parse_tree("topk:2,2"), tree_from_paths([[0], [1], [0, 0], [1, 0], [1, 1]])):
        for _ in range(200):
            drafts = [None] * tree.size
            for kids in tree.children:
                for c, t in zip(kids, rng.sample(range(4), len(kids))):
                    drafts[c] = t
            truth = [rng.randrange(4) for _ in range(tree.max_depth)]
            best = max(tree.depths[i] for i in range(tree.size)
                       if all(drafts[a] == truth[tree.depths[a] - 1] for a in ancestors(tree, i)))
            assert script.committed(tree, drafts[1:], truth) == best + 1


def ancestors(tree, node):
    """The nodes on the path from the root (excluded) down to node (included)."""
    out = []
    while node > 0:
        out.append(node)
        node = tree.parents[node]
    return out
