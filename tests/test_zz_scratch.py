from conftest import is_waiting
def test_a(holder, lanelock, lock_dir):
    h = holder("-s", "hold")
    r = lanelock("probe")
    assert r.returncode == 1, r
    print(r.stdout)
    r = lanelock("run", "--", "true")
    print(r.stderr)
    assert r.returncode == 75
    assert h.release(3) == 3
    assert lanelock("probe").returncode == 0
def test_b(holder):
    h = holder()
