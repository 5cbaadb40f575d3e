"""lm-evaluation-harness's own computation of a local task, run through its HF back end on an
`hf/` export: `python harness.py HF_FOLDER TASK_FOLDER TASK` prints the task's metrics as JSON
(`acc`, `acc_norm`, `exact_match`, ...) and, for a loglikelihood task, `loglikelihoods`: one list
of per-choice log-likelihoods per question, in file order.

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
    scores = {key.split(",")[0]: value for key, value in results["results"][task].items() if "," in key}
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    if samples and isinstance(samples[0]["resps"][0][0], (list, tuple)):  # loglikelihood requests
        scores["loglikelihoods"] = [[float(resp[0][0]) for resp in sample["resps"]] for sample in samples]
    print(json.dumps(scores))


if __name__ == "__main__":
    main()
