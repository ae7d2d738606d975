"""Learning tests: each main algorithm, run by the real train.py on the built-in task, must really
improve the held-out greedy accuracy of the warm-started policy (200 problems never trained on).

Fixed seeds; a few hundred steps each (~1 min each on 2 CPU cores). The thresholds are well below
what the runs reach (see the note printed by each test) and far above evaluation noise (±3.5 points
at 200 problems), so a broken estimator, loss sign or weight sync fails them.
"""
import pytest

import train

COMMON = ["--quiet", "--eval-every", "0", "--seed", "0"]


def learn(tmp_path, *flags):
    res = train.main(["--out-dir", str(tmp_path), *COMMON, *flags])
    before, after = res["before"]["eval/accuracy"], res["after"]["eval/accuracy"]
    print(f"{' '.join(flags)}: accuracy {before:.3f} -> {after:.3f}")
    return before, after


@pytest.mark.parametrize("algo,steps,gain", [
    ("grpo", 300, 0.10),
    ("rloo", 300, 0.10),
    ("reinforce_pp", 300, 0.10),
    ("ppo", 300, 0.10),
    ("gspo", 300, 0.10),
])
def test_algorithm_learns(algo, steps, gain, tmp_path):
    before, after = learn(tmp_path, "--algo", algo, "--steps", str(steps))
    assert after - before >= gain, (algo, before, after)


def test_top_p_with_keep_sampling_mask_learns(tmp_path):
    before, after = learn(tmp_path, "--algo", "grpo", "--steps", "300", "--top-p", "0.9", "--keep-sampling-mask")
    assert after - before >= 0.10
