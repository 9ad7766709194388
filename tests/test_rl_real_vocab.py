"""RL on a checkpoint whose embedding is padded past its tokenizer: the trainer's log-probs, entropy
and exact KL (policy and reference) are over the tokenizer's ids, checked against float64
log-softmax over those columns; the held-out eval equals scoring each prompt alone by hand, for
dp=1 and for dp=2 with uneven shares; reward short names and the weighted combination."""

import pytest
import torch

from core.config import ModelConfig, load_config
from core.generation.generate import generate
from core.model import build_model
from core.tokenizer import load_tokenizer
from parallel.dims import ParallelDims, init_parallel, kv_replica_group
from rl.config import RLConfig
from rl.experience.math_reward import format_reward, math_reward
from rl.experience.rewards import CombinedReward, RewardConfig, build_reward, load_reward_fn

PADDED = 320  # embedding rows; the shipped tokenizer has 256 ids
MODEL = dict(vocab_size=PADDED, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=64,
             max_seq_len=64)
BASE = ["rollout.prompts_per_step=4", "rollout.group_size=2", "rollout.max_new_tokens=5", "train.steps=2",
        "kl.exact=true", "train.progress=false", "rollout.eval_prompts=3", "rollout.eval_every=1",
        "rollout.eval_k=2", "reward.use_task_reward=false", "reward.fns=[tests.reward_plugins:digits_over_6]"]


def _trainer(tp=1, dp=1):
    from rl.train import assemble

    cfg = load_config(RLConfig, None, BASE)
    mc = ModelConfig(**MODEL)
    state = init_parallel(ParallelDims(dp, tp), "cpu", mc.n_heads, mc.n_kv_heads)
    kv = kv_replica_group(state, mc.n_kv_heads)
    policy = build_model(mc, state.tp_group, kv, seed=11)
    ref = build_model(mc, state.tp_group, kv, seed=12)  # another model: the exact KL is not 0
    return assemble(cfg, state, mc, load_tokenizer(None), policy, ref)


@pytest.mark.slow  # a rollout and the float64 reference on a 320-row model
def test_heads_use_the_tokenizer_vocabulary():
    trainer = _trainer()
    V = trainer.tok.vocab_size
    assert V == 256 < PADDED
    data = trainer.make_experience(0)
    ro, m = data.ro, data.mask
    assert int(ro.responses_ids[m].max()) < V  # never sampled past the tokenizer
    P = ro.prompt_len
    with torch.no_grad():
        lp = trainer.policy(ro.sequences, attention_mask=ro.attention_mask)[:, P - 1:-1, :V].double().log_softmax(-1)
        lr = trainer.ref(ro.sequences, attention_mask=ro.attention_mask)[:, P - 1:-1, :V].double().log_softmax(-1)
    want_logp = lp.gather(-1, ro.responses_ids.unsqueeze(-1)).squeeze(-1)
    want_ref = lr.gather(-1, ro.responses_ids.unsqueeze(-1)).squeeze(-1)
    want_ent = -(lp.exp() * lp).sum(-1)
    want_kl = (lp.exp() * (lp - lr)).sum(-1)  # KL(pi || ref) over the tokenizer's ids
    # the first mini-batch's rows get their old values from the update's on-policy forward
    # (algo.old_from_update): after it, every row holds the step-0 policy's values
    assert data.deferred is not None and 0 < data.deferred.numel() <= m.shape[0]
    trainer.update(data, 0)
    for got, want in ((data.old_logp, want_logp), (data.ref_logp, want_ref), (data.entropy, want_ent),
                      (data.kl, want_kl)):
        torch.testing.assert_close(got[m].double(), want[m], rtol=0, atol=2e-5)
    assert float(want_kl[m].mean()) > 1e-3


def _eval_by_hand(trainer):
    """Each eval prompt alone, greedy, scored with the reward; and k samples with the rollout's settings."""
    cfg, tok = trainer.cfg.rollout, trainer.tok
    greedy, sampled = [], []
    for i, (ids, meta) in enumerate(trainer.eval_prompts):
        x = torch.tensor([ids])
        g = generate(trainer.policy, x, torch.ones_like(x), max_new_tokens=cfg.max_new_tokens, eos_id=tok.eos_id,
                     pad_id=tok.pad_id, temperature=0.0, vocab_limit=tok.vocab_size, seed=trainer.cfg.train.seed,
                     step=0, row_ids=torch.tensor([i]))
        resp = g.sequences[0, g.prompt_len:][g.response_mask[0].bool()].tolist()
        greedy.append(trainer.reward_fn(meta, tok.decode([t for t in resp if t != tok.eos_id])))
        rows = torch.tensor([i * cfg.eval_k + j for j in range(cfg.eval_k)])
        xs = x.repeat(cfg.eval_k, 1)
        s = generate(trainer.policy, xs, torch.ones_like(xs), max_new_tokens=cfg.max_new_tokens, eos_id=tok.eos_id,
                     pad_id=tok.pad_id, temperature=cfg.temperature, vocab_limit=tok.vocab_size,
                     seed=trainer.cfg.train.seed, step=0, row_ids=rows)
        for r in range(cfg.eval_k):
            resp = s.sequences[r, s.prompt_len:][s.response_mask[r].bool()].tolist()
            sampled.append(trainer.reward_fn(meta, tok.decode([t for t in resp if t != tok.eos_id])))
    return sum(greedy) / len(greedy), sum(sampled) / len(sampled)


def _eval(dp):
    trainer = _trainer(dp=dp)
    return trainer.evaluate(0), trainer.evaluate(1)


@pytest.mark.slow  # two ranks, generation by hand per prompt
def test_eval_equals_scoring_each_prompt_alone(dist_pools):
    trainer = _trainer()
    got = trainer.evaluate(0)
    pass1, mean_k = _eval_by_hand(trainer)
    assert got["eval_n"] == 3
    assert got["eval_pass1"] == pytest.approx(pass1, abs=1e-6)
    assert got["eval_mean_at_k"] == pytest.approx(mean_k, abs=1e-6)
    assert 0 < pass1 or 0 < mean_k  # the digit reward is dense: the comparison is not 0 == 0
    res = dist_pools.run(2, _eval, 2)  # 3 prompts over dp=2: shares 2 and 1, the short one padded
    for r in res:
        assert r[0]["eval_n"] == 3
        assert r[0]["eval_pass1"] == pytest.approx(pass1, abs=1e-6)
        assert r[0]["eval_mean_at_k"] == pytest.approx(mean_k, abs=1e-6)


def test_reward_short_names_and_weights():
    assert load_reward_fn("math") is math_reward and load_reward_fn("format") is format_reward
    cfg = RewardConfig(task="arithmetic", fns=["math", "format"], combine="weighted", weights=[0.5, 1.0, 0.25])
    task, fn, _ = build_reward(cfg)
    meta = {"prompt": "3+4=", "answer": "7"}
    for resp in ("7", "#### 7", "8", "#### 8", "x"):
        want = 0.5 * task.reward(meta, resp) + 1.0 * math_reward(meta, resp) + 0.25 * format_reward(meta, resp)
        assert fn(meta, resp) == want
    assert fn(meta, "#### 7") == 1.25  # task reward 0 (not the bare answer), math 1, format 1
    no_task = build_reward(RewardConfig(task=None, fns=["math"]))
    assert no_task[0] is None and no_task[1] is not None
    assert CombinedReward(["math", "format"], "min")({"answer": "7"}, "7") == 0.0


@pytest.mark.parametrize("kw, msg", [
    (dict(combine="weighted", fns=["math"]), "one weight per reward function"),
    (dict(combine="weighted", fns=["math"], weights=[1.0]), "one weight per reward function (2"),
    (dict(combine="mean", fns=["math"], weights=[1.0, 2.0]), "combine='weighted'"),
    (dict(task=None), "reward.fns needs at least one"),
    (dict(combine="sum"), "'mean', 'min' or 'weighted'"),
])
def test_reward_config_errors(kw, msg):
    with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace("'", "'")):
        RewardConfig(**kw)


def test_bad_short_name_is_named():
    with pytest.raises(ValueError, match="'maths'.*one of"):
        load_reward_fn("maths")


def test_data_section_or_task_required():
    with pytest.raises(ValueError, match="reward.task is null and there is no data section"):
        load_config(RLConfig, None, ["reward.task=null", "reward.fns=[math]"])


def _data_cfg(*extra):
    data = "core/data/arith_word_train.jsonl"
    return load_config(RLConfig, None, ["reward.task=null", "reward.fns=[math]", f"data.train_file={data}",
                                        "data.prompt_field=question", "data.apply_chat_template=false",
                                        "rollout.prompts_per_step=8", "train.steps=4", *extra])


def test_data_prompts_checked_at_start_and_split_over_dp():
    from core.config import ConfigError
    from rl.train import prompt_sources

    tok = load_tokenizer(None)
    with pytest.raises(ConfigError, match="max_seq_len=20"):
        prompt_sources(_data_cfg(), tok, None, max_seq_len=20)
    with pytest.raises(ConfigError, match="train.steps=40 is past the data"):
        prompt_sources(_data_cfg("train.steps=40"), tok, None, max_seq_len=4096)
    source, evals = prompt_sources(_data_cfg(), tok, None, max_seq_len=4096)
    assert evals is None
    whole = source.rank_prompts(8, 0, 3, 0, 1)
    halves = [source.rank_prompts(8, 0, 3, r, 2) for r in range(2)]
    assert halves[0][0] == 0 and halves[1][0] == 4
    assert halves[0][1] + halves[1][1] == whole[1] and halves[0][2] + halves[1][2] == whole[2]
    texts = [m["prompt"] for m in whole[2]]
    assert whole[1] == [[tok.bos_id] + tok.encode(t) for t in texts]  # bos once, from rl.experience.prompts
