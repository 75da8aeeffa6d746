import pytest

from tests.scenario_runner import run, scenario_files


@pytest.mark.parametrize("path", scenario_files(), ids=lambda p: p.stem)
def test_scenario(path):
    run(path)


def test_there_are_scenarios():
    assert len(scenario_files()) >= 5
