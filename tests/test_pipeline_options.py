"""Layer and stage options: what they accept, and errors that name the bad argument."""

import math

import pytest

import autopar


def test_manual_stage_option_normalises_lists_to_tuples():
    option = autopar.ManualStageOption([[0, 1], [2]], [[1, 4], [1, 4]], [[2, 2], [4, 1]])
    assert option.forward_stage_layer_ids == ((0, 1), (2,))
    assert option.submesh_physical_shapes == ((1, 4), (1, 4))
    assert option.submesh_logical_shapes == ((2, 2), (4, 1))
    assert autopar.AutoStageOption().stage_imbalance_tolerance == math.inf


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (([[0], [1]], [(1, 4)], [(1, 4)]), "one entry per stage; got 2, 1 and 1"),
        (([[0], [2]], [(1, 4)] * 2, [(1, 4)] * 2), "consecutive"),
        (([[1, 0]], [(1, 4)], [(1, 4)]), "consecutive"),
        (([[0], []], [(1, 4)] * 2, [(1, 4)] * 2), "non-empty"),
        (([[0]], [(1, 4)], [(2, 4)]), "logical mesh \\(2, 4\\) has 8 devices but its sub-mesh"),
        (([[0]], [(0, 4)], [(1, 4)]), "submesh_physical_shapes must be a positive integer"),
        (([[0]], [(1, 4, 1)], [(1, 4)]), "submesh_physical_shapes must be a \\(rows, columns\\)"),
    ],
)
def test_bad_manual_stage_options(args, message):
    with pytest.raises(autopar.InvalidArgumentError, match=message):
        autopar.ManualStageOption(*args)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: autopar.AutoStageOption(submesh_physical_shape_space="x"), "physical_shape"),
        (lambda: autopar.AutoStageOption(submesh_logical_shape_space="x"), "logical_shape"),
        (lambda: autopar.AutoStageOption(stage_imbalance_tolerance=0.5), "imbalance"),
        (lambda: autopar.UniformStageOption(num_stages=0), "num_stages"),
        (lambda: autopar.UniformStageOption(submesh_logical_shape=(2,)), "logical_shape"),
        (lambda: autopar.AutoLayerOption(layer_num=True), "layer_num"),
    ],
)
def test_bad_stage_and_layer_options(make, message):
    with pytest.raises(autopar.InvalidArgumentError, match=message):
        make()
