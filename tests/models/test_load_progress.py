"""Model loading shows a tqdm bar on stderr once it has taken a second, and stays quiet when it is quick."""

import time

from cpuinfer.model_loader import _progress


def slow(n: int, pause: float):
    for i in range(n):
        time.sleep(pause)
        yield str(i), i


def test_a_slow_load_shows_progress(capsys):
    assert dict(_progress(slow(3, 0.6), 3)) == {"0": 0, "1": 1, "2": 2}
    err = capsys.readouterr().err
    assert "Loading weights" in err and "3/3" in err


def test_a_quick_load_prints_nothing(capsys):
    assert len(dict(_progress(slow(3, 0.0), 3))) == 3
    assert capsys.readouterr().err == ""
