"""Research tools: the online-learning identity checks and the gate-granularity ablation runner.

    python experiments/online_learning.py          # the checks table
    python -m lineattn.experiments.ablate --config configs/ablate_mqar.yaml
"""
