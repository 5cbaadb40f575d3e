"""lm-evaluation-harness's own computation of a local task, run through its HF back end on an
`hf/` export: `python harness.py HF_FOLDER TASK_FOLDER TASK` prints {"acc", "acc_norm",
"loglikelihoods"} as JSON (one list of per-choice log-likelihoods per question, in file order).

A process of its own: the offline switches and the datasets cache (inside the task folder) are
read when `datasets` is imported, and the harness seeds global generators. Run from the task
folder, so the YAML's relative `data_files` name the file beside it.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    hf, folder, task = sys.argv[1:4]
    os.chdir(folder)
    os.environ.update(
        HF_DATASETS_OFFLINE="1",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_CACHE=os.path.join(folder, "datasets-cache"),
        HF_HOME=os.path.join(folder, "hf-home"),
    )
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    results = simple_evaluate(
        model="hf",
        model_args={"pretrained": hf, "dtype": "float32", "device": "cpu"},
        tasks=[task],
        task_manager=TaskManager(include_path=folder, include_defaults=False),
        batch_size=4,
        log_samples=True,
    )
    scores = results["results"][task]
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    loglikelihoods = [[float(resp[0][0]) for resp in sample["resps"]] for sample in samples]
    print(
        json.dumps(
            {"acc": scores["acc,none"], "acc_norm": scores["acc_norm,none"], "loglikelihoods": loglikelihoods}
        )
    )


if __name__ == "__main__":
    main()
