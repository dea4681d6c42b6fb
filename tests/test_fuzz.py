"""Fuzzing on fixed seeds (tests/fuzzing.py): a random small model × method × mesh × micro-batch
count either gives the serial step's parameters and metrics after 2 steps, or is refused with
an `autopar.AutoparError` that says why. `python benchmarks/fuzz.py` runs many more seeds."""

import pytest
from fuzzing import NUM_DEVICES, draw_case, run_case

# Picked from seeds 0..199 to cover every method, mesh, micro-batch count, layer and stage
# option, schedule and model feature at least once, with more pipeshard cases than a random
# draw gives (the method with the most moving parts).
SEEDS = (0, 1, 2, 3, 4, 6, 7, 9, 11, 22, 24, 25, 32, 33, 45, 46, 50, 58, 61, 65, 73, 98)
CASES = [draw_case(seed) for seed in SEEDS]


@pytest.mark.parametrize("case", CASES, ids=[case.describe() for case in CASES])
def test_parallel_step_matches_serial_or_is_refused(case):
    result = run_case(case)
    assert result.ok, (
        f"{result.status}: {result.error_type}: {result.error}\n"
        f"at {result.location}\n{result.traceback}"
    )


def test_draws_are_reproducible_and_valid():
    """A seed always draws the same case, and every case is one autopar should be able to run:
    the batch splits over devices × micro-batches, stages divide the devices and are no more
    than the layers, dropout only with one micro-batch."""
    for seed in range(300):
        case = draw_case(seed)
        assert case == draw_case(seed)
        assert 1 <= case.depth <= 4
        assert case.batch_size % (NUM_DEVICES * case.micro_batches) == 0
        assert not case.dropout or case.micro_batches == 1
        if case.method == "pipeshard":
            layers = case.depth if case.layer_option == "manual" else case.layer_num
            assert case.layer_num is None or case.layer_num <= case.depth + 1
            if case.num_stages is not None:
                assert NUM_DEVICES % case.num_stages == 0 and case.num_stages <= layers
    assert len({draw_case(seed).describe() for seed in range(300)}) == 300
