"""Eval-only replay: asyncspade's ``sum_softmax`` scored in one pass with the previous
step's per-head normaliser (the logsumexp of the predicted q_{t-1} over keys [0, t-1)),
against the exact two-pass ``sum_softmax`` and ``sum_logits``; "stale_max" keeps only the
previous step's per-head max. Recall as ``spade eval`` selection measures it.

    PYTHONPATH=. python scripts/replays/stale_normaliser.py smollm2-135m 4096 1 out.json
"""
import sys, json, torch
from spade.eval import selection as S
from spade.eval.config import SelectionEvalConfig
from spade.eval.capture import capture_qk
from spade.eval.common import load_model, essay_token_segments
from spade.models.hf import attention_spec
from spade.policies.asyncspade import AsyncSpadePolicy, AsyncSpadePolicyConfig

name = sys.argv[1]; T = int(sys.argv[2]); ntext = int(sys.argv[3]) if len(sys.argv) > 3 else 1
cfg = SelectionEvalConfig(models=[name], context_tokens=T, start=T // 4, positions=32, budgets=[128, 256],
                          context_fractions=[16], predictors=["assembled"], rope_aware=[True],
                          group_reduces=["sum_softmax", "sum_logits"], baselines=["oracle"], distances=[])
model, tok = load_model(name, "cpu")
spec = attention_spec(model)
acc = S.Acc(spec.n_layers)

class R(S._LayerReplay):
    def run(self):
        ref = self.ref = self.ranked(self.q_t, self.reduces)
        for red in self.reduces:
            self.record_ranked("oracle", red, ref[red], ref[red])
        cfgp = AsyncSpadePolicyConfig(budget=self.kmax + self.n_fixed, predictor="assembled", window=self.cfg.window,
                                      ridge_eps=self.cfg.ridge_eps, rope_aware=True, **self.common)
        pol = AsyncSpadePolicy(cfgp, self.spec)
        R_ = self.cfg.window + 1
        def qhat(shift):
            win = torch.stack([self.q[:, int(t) - shift - R_:int(t) - shift] for t in self.ts.tolist()])
            st = S._state(pol, self.B, int(self.ts.max()), self.dev)
            pol.prefill(st, 0, win, self.kc, self.kc, self.kv_pre - shift)
            st.seq_len += 1
            return pol.predict_query(st, 0, self.kv_sel - shift)
        qh, qp = qhat(0), qhat(1)
        for red, rk in self.ranked(qh, self.reduces).items():
            self.record_ranked("asy", red, rk, self.ref[red])
        B, Hq, D = qh.shape
        Hkv, L = self.k.shape[0], self.k.shape[1]
        def logits(qv):
            qg = qv.float().view(B, Hkv, Hq // Hkv, D)
            return torch.einsum("bhgd,hld->bhgl", qg, self.k.float()) * self.spec.softmax_scale
        pos = torch.arange(L)
        lg = logits(qh)
        valid = pos[None, :] < self.kv_sel.long()[:, None]
        lgp = logits(qp).masked_fill(~(pos[None, :] < (self.kv_sel.long() - 1)[:, None])[:, None, None, :], float("-inf"))
        lse_prev = torch.logsumexp(lgp, -1, keepdim=True)  # [B, Hkv, G, 1]
        s = torch.exp(lg - lse_prev).sum(2)
        s = torch.where(valid[:, None, :], s, torch.tensor(float("-inf")))
        self.record_ranked("asy", "softmax_stale_norm", S.Ranked(s, self.lo, self.hi, self.kmax), self.ref["sum_softmax"])
        # per-head (max-only) stale: exp(l - m_prev) without z: weights heads by max only
        m_prev = lgp.amax(-1, keepdim=True)
        s2 = torch.where(valid[:, None, :], torch.exp(lg - m_prev).sum(2), torch.tensor(float("-inf")))
        self.record_ranked("asy", "softmax_stale_max", S.Ranked(s2, self.lo, self.hi, self.kmax), self.ref["sum_softmax"])

for ids in essay_token_segments(tok, T, ntext):
    cap = capture_qk(model, ids)
    ts = S.positions_for(cfg, T)
    for layer in range(len(cap.q)):
        for c in range(0, len(ts), cfg.batch_positions):
            R(cfg, spec, cap.q[layer], cap.k[layer], ts[c:c + cfg.batch_positions], layer, acc).run()
rows = S.summarize(acc)
out = {"model": name, "context_tokens": T, "texts": ntext, "positions": S.positions_for(cfg, T).tolist(),
       "predictor": "assembled, rope_aware", "rows": [{k: r[k] for k in ("budget", "policy", "reduce", "recall", "overlap")}
                                                      for r in rows]}
if len(sys.argv) > 4:
    json.dump(out, open(sys.argv[4], "w"), indent=1)
for r in rows:
    print(f"{r['budget']:>10} {r['policy']:>8} {r['reduce']:>20} recall {r['recall']:.4f} overlap {r.get('overlap', float('nan')):.4f}")
