"""The Markdown report of a training experiment (``experiments.training.TrainingResult``)."""
from __future__ import annotations

from attnlab.harness import markdown_table

__all__ = ["training_report"]


def _task_text(task: str, sz: dict) -> str:
    return {"recall": f"associative recall (length {sz['seq_len']['recall']}, 4 key-value pairs, 16 classes, "
                      "read at the last token)",
            "text": f"byte-level next-token prediction on docstrings of Python's standard library "
                    f"(length {sz['seq_len']['text']}, causal)"}[task]


def training_report(res) -> str:
    """report.md of a ``TrainingResult``: setup, outcomes per (task, d_k, arm) as mean ± std over seeds,
    the verdicts against the baseline, the environment."""
    sz = res.sizes
    lm = res.model == "lm"
    md = [f"# attnlab experiment {res.experiment}", "", *res.intro, "",
          (f"Setup: attnlab.nn.TransformerLM (RoPE, tied embeddings), {sz['num_layers']} layers, 2 heads of d_k each "
           "(d_model = 2·d_k), " if lm else
           f"Setup: a {sz['num_layers']}-layer pre-norm Transformer (attnlab.nn encoder layers), d_model "
           f"{sz['d_model']}, 2 heads of d_k each, ")
          + f"{sz['steps']} steps of batch {sz['batch_size']}, {res.optimizer} at lr {res.lr}, seeds {res.seeds}, "
          f"W_Q/W_K init: {res.qk_init if not lm else 'the library default'}. Tasks: "
          + ", ".join(_task_text(t, sz) for t in res.tasks)
          + f". {sz['train']} training and {sz['test']} held-out examples."
          + (" **Quick mode: toy sizes, the numbers say nothing.**" if res.quick else ""), "",
          "![curves](curves.png)", "", "## Outcomes (mean ± std over seeds)", ""]
    rows = []
    for r in res.summary:
        def pm(k, r=r):
            return None if r[k] is None else (f"{r[k]:.3g} ± {r[k + '_std']:.2g}" if r[k + "_std"] else f"{r[k]:.3g}")
        rows.append([r["task"], r["head_dim"], r["arm"], pm("eval_loss"), pm("eval_accuracy"), pm("final_loss"),
                     pm("entropy_init"), pm("entropy_final"), pm("max_weight_init"), pm("qk_grad_norm_init"),
                     r["diverged"], pm("steps_per_s")])
    md.append(markdown_table(["task", "d_k", "arm", "held-out loss", "held-out acc", "final train loss",
                              "entropy at init", "entropy at end", "max weight at init", "‖grad W_Q,W_K‖ at init",
                              "diverged", "steps/s"], rows))
    md += ["", "## Verdicts", "",
           "An arm counts as worse or better only when its mean held-out loss differs from the baseline's by more "
           "than twice the larger seed standard deviation (at least 0.02).", ""]
    md += [f"- {v['task']}, d_k = {v['d_k']}, **{v['arm']}**: {v['verdict']}" for v in res.verdicts]
    md += ["", "## Environment", "", "```", *[f"{k}: {v}" for k, v in res.environment.items() if k != "argv"], "```", ""]
    return "\n".join(md)
