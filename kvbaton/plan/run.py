"""One `kvbaton plan`: build the setting from a scenario, search or diagnose, print, write JSON and plots."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from kvbaton.config import ConfigError
from kvbaton.plan.actions import propose_actions
from kvbaton.plan.deployment import Setting
from kvbaton.plan.diagnose import diagnose, explain
from kvbaton.plan.evaluate import Harness, SimOptions
from kvbaton.plan.examples import Scenario
from kvbaton.plan.report import print_diagnosis, print_header, print_plan, write_json
from kvbaton.plan.search import Progress, SearchSpace, search
from kvbaton.sim.hardware import hardware_preset
from kvbaton.sim.links import link_preset
from kvbaton.sim.model_spec import resolve_model


def setting_of(scenario: Scenario) -> Setting:
    return Setting(model=resolve_model(scenario.model), hardware=hardware_preset(scenario.hardware),
                   kv_link=link_preset(scenario.kv_link), max_model_len=max(8192, scenario.workload.max_seq_len + 1))


def run_scenario(scenario: Scenario, options: SimOptions, console: Console, note: Progress, *,
                 json_path: str | None = None, plot_dir: str | None = None) -> int:
    harness = Harness.build(setting_of(scenario), scenario.workload, options)
    print_header(harness, console)
    for line in scenario.notes:
        console.print(f"note: {line}")
    document = run_diagnosis(scenario, harness, console, note, plot_dir) if scenario.observation else \
        run_search(scenario, harness, console, note, plot_dir)
    if json_path:
        write_json(json_path, {"scenario": scenario, "options": options, **document})
        console.print(f"result: {json_path}")
    return 0


def run_search(scenario: Scenario, harness: Harness, console: Console, note: Progress,
               plot_dir: str | None) -> dict:
    space = SearchSpace(tps=scenario.tps, pps=scenario.pps, disaggregation=scenario.search_pd,
                        try_ep=scenario.try_ep, device_budget=scenario.devices)
    result = search(harness, scenario.deployment, space, note)
    print_plan(result, console)
    if plot_dir:
        _plots(plot_dir, list(result.candidates), scenario.title, console, None)
    return {"candidates": result.candidates, "recommended": result.recommended,
            "disaggregation": result.disaggregation}


def run_diagnosis(scenario: Scenario, harness: Harness, console: Console, note: Progress,
                  plot_dir: str | None) -> dict:
    assert scenario.observation is not None
    devices, current = scenario.devices, scenario.deployment
    if devices is None or devices < current.unit_devices:
        raise ConfigError(f"the deployment diagnosed ({current.label}) needs at least {current.unit_devices} GPUs")
    if not harness.setting.memory(current).fits(harness.load.max_seq_len):
        raise ConfigError(f"{current.label}: {harness.setting.model.name} does not fit on "
                          f"{harness.setting.hardware.name} with room for one {harness.load.max_seq_len}-token "
                          "sequence")
    found = diagnose(harness, current, devices, scenario.observation, note)
    actions = propose_actions(harness, found.current, devices, note)
    print_diagnosis(found, actions, harness, console)
    if plot_dir:
        tried = [found.current] + [c for a in actions for c in a.tried]
        _plots(plot_dir, sorted(tried, key=lambda c: -c.per_device), scenario.title, console,
               found.current.deployment.label)
    return {"diagnosis": found, "findings": explain(found), "actions": actions}


def _plots(plot_dir: str, candidates: list, title: str, console: Console, highlight: str | None) -> None:
    from kvbaton.plan.plots import write_plots

    for path in write_plots(Path(plot_dir), candidates, title, highlight):
        console.print(f"plot: {path}")
