"""The built-in run's defaults (issue 23): `python train.py --algo grpo` picks one torch thread unless
told otherwise (two threads on a busy 2-core machine stall each other: bench.py --only default_threads),
and leaves torch's default alone for a model the user names.

Run: python -m pytest tests/test_default_run.py -q
"""
import torch

import train
from nanorl.config import parse_args


def test_builtin_run_uses_one_thread_unless_told(tmp_path):
    base = ["--algo", "grpo", "--quiet", "--steps", "1", "--eval-every", "0", "--out-dir", str(tmp_path)]
    try:
        for extra, want in (([], 1), (["--threads", "2"], 2)):
            torch.set_num_threads(2 if want == 1 else 1)  # a different count before setup
            run = train.setup(parse_args(base + extra))
            run.rewards.close()
            run.logger.close()
            assert torch.get_num_threads() == want, (extra, torch.get_num_threads())
        torch.set_num_threads(2)
        model = run.cfg.model  # the built-in model's directory, named as a user's model
        run = train.setup(parse_args(base + ["--model", model, "--train-data", run.cfg.train_data]))
        run.rewards.close()
        run.logger.close()
        assert torch.get_num_threads() == 2  # a named model: torch's default (here: what was set) stays
    finally:
        torch.set_num_threads(1)  # as tests/conftest.py set it
