"""Lossless sampling, checked statistically: the speculative sampler's distribution over the first
four generated tokens equals plain sampling from the target; a wrong acceptance rule fails the same test."""
import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chi2

import specc
import specc.passes.accept as accept_pass
from specc.acceptance import accept
from tiny import tiny_model

V, NEW, RUNS = 8, 4, 1500
PROMPT = [3, 5, 2, 7]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("sampling")
    target = tiny_model("llama", vocab=V, layers=2, seed=0, scale=4.0)
    draft = tiny_model("llama", vocab=V, layers=1, seed=1, scale=4.0)
    target.save_pretrained(root / "target")
    draft.save_pretrained(root / "draft")
    return root, target


def exact_distribution(target, temperature: float, prompt=PROMPT) -> np.ndarray:
    """p(x1..x4 | prompt) for all V^4 continuations, by enumeration."""
    seqs = torch.tensor([list(prompt) + list(s) for s in itertools.product(range(V), repeat=NEW - 1)])
    with torch.no_grad():
        logp = torch.log_softmax(target(seqs).logits.double() / temperature, dim=-1)
    L = len(prompt)
    joint = logp[:, L - 1, :]  # p(x1), same for every row
    total = np.zeros((V,) * NEW)
    for row, s in enumerate(itertools.product(range(V), repeat=NEW - 1)):
        lp = logp[row, L - 1, s[0]] + logp[row, L, s[1]] + logp[row, L + 1, s[2]]
        total[s] = (lp + logp[row, L + 2, :]).exp().numpy()
    del joint
    return total


def g_test(samples: list[tuple], probs: np.ndarray) -> float:
    """G-test of sampled 4-token outcomes against exact probabilities; sparse cells pooled (expected < 5)."""
    n = len(samples)
    counts = np.zeros(probs.size)
    for s in samples:
        counts[np.ravel_multi_index(s, probs.shape)] += 1
    expected = probs.ravel() * n
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    nz = obs > 0
    g = 2 * np.sum(obs[nz] * np.log(obs[nz] / exp[nz]))
    return float(chi2.sf(g, len(obs) - 1))


def sample_runs(root, tmp_path, tree="chain:3", backend="eager"):
    path = specc.compile(root / "target", drafter="draft-model", drafter_path=root / "draft", tree=tree,
                         backend=backend, output_dir=tmp_path / "engine", max_len=32, prefill_chunk=4,
                         progress=False, modes="sample")
    engine = specc.load(path)
    out, steps = [], 0
    for seed in range(RUNS):
        r = engine.generate(PROMPT, max_new_tokens=NEW, temperature=1.0, seed=seed, stop_at_eos=False)
        out.append(tuple(r.token_ids))
        steps += r.stats.steps
    return out, steps


# onnx: the acceptance rule as standard ONNX operators, run by onnxruntime
BACKENDS = ["eager", pytest.param("onnx", marks=pytest.mark.skipif(
    __import__("importlib").util.find_spec("onnxruntime") is None, reason="onnxruntime is not installed"))]


@pytest.mark.parametrize("backend", BACKENDS)
def test_speculative_sampling_matches_target(models, tmp_path, backend):
    root, target = models
    samples, steps = sample_runs(root, tmp_path, backend=backend)
    assert steps < RUNS * (NEW - 1)  # drafts were accepted, so the rule was exercised
    p = g_test(samples, exact_distribution(target, 1.0))
    assert p > 1e-3, f"speculative samples differ from the target distribution (p={p:.2e})"


@pytest.mark.parametrize("backend", BACKENDS)
def test_wrong_acceptance_rule_is_detected(models, tmp_path, monkeypatch, backend):
    """Negative control: accepting drafts with probability min(1, 2 p(x)) must fail the same test."""
    def over_accepting(logits, tokens, parents, children, temperature, top_p, uniforms, draft_probs=None, mode=None):
        if mode == "greedy":  # the draft model's graphs
            return accept(logits, tokens, parents, children, temperature, top_p, uniforms, draft_probs, mode=mode)
        u = torch.cat([uniforms[:-1] * 0.5, uniforms[-1:]])
        return accept(logits, tokens, parents, children, temperature, top_p, u, draft_probs, mode=mode)

    monkeypatch.setattr(accept_pass, "accept_tree", over_accepting)
    root, target = models
    samples, _ = sample_runs(root, tmp_path, backend=backend)
    p = g_test(samples, exact_distribution(target, 1.0))
    assert p < 1e-3, f"the wrong rule was not detected (p={p:.2e})"


# Its last three tokens occurred before, followed by what the target likes to sample next: prompt
# lookup's continuation is often accepted.
REPEATING = [0, 1, 6, 7, 4, 6, 0, 1, 6]


def tree_samples(root, target, tmp_path, children, prompt=PROMPT, ngram_branch=0):
    """Samples from a DFlash topk:2,2 engine through the fused step graph (with prompt lookup's
    branch: a hybrid tree), how many steps accepted a second-ranked child, and how many took
    lookup's tokens."""
    from test_engine import random_dflash

    dpath, _ = random_dflash(target, tmp_path / "dflash", block=3)
    path = specc.compile(root / "target", drafter="dflash", drafter_path=dpath, tree="topk:2,2", backend="eager",
                         output_dir=tmp_path / "engine", max_len=32, prefill_chunk=4, progress=False,
                         children=children, modes="sample", ngram_branch=ngram_branch)
    engine = specc.load(path)
    samples, branched, lookups = [], 0, 0
    for seed in range(RUNS):
        r = engine.generate(prompt, max_new_tokens=NEW, temperature=1.0, seed=seed, stop_at_eos=False)
        samples.append(tuple(r.token_ids))
        branched += sum(any(rank > 0 for rank in p) for p in r.stats.rank_paths)
        lookups += r.stats.lookup_accepted
    return samples, branched, lookups


@pytest.mark.parametrize("children", ["topk", "sampled"])
def test_speculative_sampling_on_a_tree_matches_target(models, tmp_path, children):
    """The same test on a branching tree (sibling retries and the residual): deterministic top-k
    children with the one-hot rule, and children drawn i.i.d. from the drafter's q with the
    min(1, p/q) rule and residuals max(p - q, 0). The top-k tree is a hybrid one (specc/hybrid.py):
    the host overwrites drafts with prompt lookup's continuation, deterministic drafts too, so the
    output must keep the target's distribution."""
    root, target = models
    hybrid = children == "topk"
    prompt = REPEATING if hybrid else PROMPT
    samples, branched, lookups = tree_samples(root, target, tmp_path, children, prompt, ngram_branch=2 if hybrid else 0)
    assert branched > 100  # second-ranked children were accepted: the sibling rule was exercised
    assert lookups > 300 if hybrid else lookups == 0  # lookup's tokens were accepted often
    p = g_test(samples, exact_distribution(target, 1.0, prompt))
    assert p > 1e-3, f"speculative samples on a tree differ from the target distribution (p={p:.2e})"


def test_sampled_children_with_a_wrong_q_are_detected(models, tmp_path, monkeypatch):
    """Negative control for sampled children: a verifier that takes the children for draws from the
    uniform distribution (not the drafter's q they came from) must fail the same test."""
    traced_with_q = []

    def wrong_q(logits, tokens, parents, children, temperature, top_p, uniforms, draft_probs=None, mode=None):
        if draft_probs is None:  # the plain graph (a tree without drafts)
            return accept(logits, tokens, parents, children, temperature, top_p, uniforms, mode=mode)
        traced_with_q.append(1)
        return accept(logits, tokens, parents, children, temperature, top_p, uniforms,
                      torch.full_like(draft_probs, 1.0 / V), mode=mode)

    monkeypatch.setattr(accept_pass, "accept_tree", wrong_q)
    root, target = models
    samples, _, _ = tree_samples(root, target, tmp_path, "sampled")
    assert traced_with_q  # the step graph verifies sampled children with a q
    p = g_test(samples, exact_distribution(target, 1.0))
    assert p < 1e-3, f"the wrong q was not detected (p={p:.2e})"


def test_adaptive_sampling_matches_target(models, tmp_path, monkeypatch):
    """The same test on an adaptive ngram engine whose choice of step graph varies from step to step
    (plain, 2, 3 and 4 nodes): the choice depends on the text so far, never on the step's own draws,
    so it must not bias the output. Sampling chooses from the compiled table, never from step times
    measured as it runs, so a seed gives the same output again."""
    root, target = models
    prompt = [3, 5, 2, 7, 3, 5, 2, 7, 3, 5, 2]  # repeats: the ngram drafter finds matches
    path = specc.compile(root / "target", drafter="ngram", tree="chain:3", backend="eager", adaptive=True,
                         output_dir=tmp_path / "engine", max_len=32, prefill_chunk=4, progress=False, modes="sample")
    engine = specc.load(path)
    # Latencies and rates fixed so that the choice follows the drafts' confidence (specc/adaptive.py):
    # confident -> the whole chain, half sure -> 2 nodes, no evidence -> plain.
    # min_ngram is 1 in an adaptive engine: a random model rarely repeats 3-grams, single tokens do.
    engine.adaptive = {**engine.adaptive, "latency_ms": [1.0, 1.3, 1.6, 1.9], "rates": [[0.1, 0.3, 0.5, 0.7, 0.9, 0.95]] * 4}
    monkeypatch.setattr(engine, "step_clock", lambda: pytest.fail("a sampling generation read step times"))
    samples, sizes = [], {}
    for seed in range(RUNS):
        r = engine.generate(prompt, max_new_tokens=NEW, temperature=1.0, seed=seed, stop_at_eos=False)
        samples.append(tuple(r.token_ids))
        for k, n in r.stats.verified_sizes.items():
            sizes[k] = sizes.get(k, 0) + n
    assert sum(n > 500 for n in sizes.values()) >= 3, sizes  # several members of the family ran, often
    again = engine.generate(prompt, max_new_tokens=NEW, temperature=1.0, seed=0, stop_at_eos=False)
    assert tuple(again.token_ids) == samples[0]
    p = g_test(samples, exact_distribution(target, 1.0, prompt))
    assert p > 1e-3, f"adaptive speculative samples differ from the target distribution (p={p:.2e})"



def test_adaptive_fused_sampling_matches_target(models, tmp_path):
    """The same test on an adaptive DSpark engine: a family of fused steps, each call's member chosen
    from the confidences its previous call returned (a function of the text so far, never of the
    step's own draws), so the choice must not bias the output; nor must the plain steps while its
    drafter rests, nor the probes that wake it (the drafter's own graph drafts from the waiting rows)."""
    from test_dspark import random_dspark

    root, target = models
    dpath, _ = random_dspark(target, tmp_path / "dspark", block=2)
    path = specc.compile(root / "target", drafter="dspark", drafter_path=dpath, tree="topk:1,2", backend="eager",
                         adaptive=True, output_dir=tmp_path / "engine", max_len=32, prefill_chunk=4, progress=False,
                         modes="sample")
    engine = specc.load(path)
    assert engine.adaptive["graphs"] == ["fused1", "fused2", "fused"]
    # Rates that rise with the confidence head's number, so the member varies with the drafts, and a
    # plain step cheaper than fused1, so that unlikely drafts rest the drafter.
    engine.adaptive = {**engine.adaptive, "latency_ms": [1.0, 1.3, 1.6], "rest_ms": 0.95,
                       "rates": [[0.0, 0.5, 0.7, 0.9, 0.95, 0.95], [0.0, 0.1, 0.2, 0.5, 0.9, 0.95]]}
    samples, graphs = [], {}
    for seed in range(RUNS):
        r = engine.generate(PROMPT, max_new_tokens=NEW, temperature=1.0, seed=seed, stop_at_eos=False)
        samples.append(tuple(r.token_ids))
        for name, n in r.stats.graphs.items():
            graphs[name] = graphs.get(name, 0) + n
    assert sum(n > 300 for n in graphs.values()) >= 3, graphs  # rests and several members ran, often
    p = g_test(samples, exact_distribution(target, 1.0))
    assert p > 1e-3, f"adaptive fused samples differ from the target distribution (p={p:.2e})"


def test_corpus_table_sampling_matches_target(models, tmp_path):
    """The same test on an ngram engine with a corpus table (specc/corpus.py): on a prompt without
    repeats prompt lookup rarely matches and the table drafts most steps; its drafts are
    deterministic, so the one-hot rule must keep the target's distribution."""
    import json

    root, target = models
    g = torch.Generator().manual_seed(3)
    corpus = [{"ids": torch.randint(0, V, (40,), generator=g).tolist()} for _ in range(3)] * 3
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps(c) + "\n" for c in corpus))
    path = specc.compile(root / "target", drafter="ngram", tree="chain:3", backend="eager", output_dir=tmp_path / "e",
                         max_len=32, prefill_chunk=4, progress=False, modes="sample",
                         ngram_corpus=str(tmp_path / "corpus.jsonl"))
    engine = specc.load(path)
    propose, tabled = engine.drafter.propose, [0]

    def counting(committed):  # the steps the table drafted
        out = propose(committed)
        tabled[0] += engine.drafter.from_corpus is not None
        return out
    engine.drafter.propose = counting
    samples, accepted = [], 0
    for seed in range(RUNS):
        r = engine.generate(PROMPT, max_new_tokens=NEW, temperature=1.0, seed=seed, stop_at_eos=False)
        samples.append(tuple(r.token_ids))
        accepted += sum(n * c for n, c in enumerate(r.stats.accepted_hist))
    assert tabled[0] > 1000 and accepted > 300, (tabled[0], accepted)  # the table drafted, and was accepted
    p = g_test(samples, exact_distribution(target, 1.0))
    assert p > 1e-3, f"samples with the corpus table's drafts differ from the target distribution (p={p:.2e})"
