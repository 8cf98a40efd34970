"""The main job's task-accuracy check is a real check: on the task instances of the default plan the trained model
(the fp64 oracle of it) solves the task, so the check compares accuracies instead of skipping."""
from __future__ import annotations

import oracle
from hybridqual.scenarios import instantiate, main_job_plan, task_traces


def test_the_default_plans_task_instances_are_solved_by_the_trained_model():
    task_instances = 0
    for model_dir, names, _files in main_job_plan():
        if model_dir.name != "tiny-sort" or not names:
            continue
        model = oracle.load(model_dir)
        for inst in instantiate(model_dir, model.config, [n for n in names if n.startswith("task_")]):
            assert inst.trace is not None and task_traces.is_task_trace(inst.trace), inst.scenario
            result = oracle.run_trace(model, inst.trace)
            accuracy = task_traces.task_accuracy(inst.trace, result.tokens)
            assert accuracy >= 0.75, f"{inst.scenario}: the oracle's accuracy is {accuracy:.3f}; the check would skip"
            task_instances += 1
    assert task_instances >= 1, "the default plan has no task instance on the trained model"
