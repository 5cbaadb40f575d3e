"""The plan: a DAG of steps, each named by the digest of everything that determines its output.

A step's hash covers its kind, the slice of config it reads, its inputs (upstream step hashes, or
the content digests of source files) and the toolchain fingerprint. A plan's hash covers its name,
its (path-free) resolved config, its steps and its targets. The stored form of a plan is exactly
the canonical bytes it was hashed from, so loading re-derives and checks every hash.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Container, Mapping
from typing import Any

import attrs

from buildtrain.canonical import canonical_bytes, digest, plain
from buildtrain.config.checks import name_problem
from buildtrain.config.convert import converter
from buildtrain.config.schema import NumericsConfig

PLAN_FORMAT = 1


@attrs.frozen(kw_only=True)
class Step:
    """One unit of work with declared inputs; `hash` names its output in the store."""

    label: str
    kind: str  # a name in the kinds' registry: checked where a stored plan is read (`from_body`)
    config: Mapping[str, Any]
    inputs: Mapping[str, Any]
    toolchain: Mapping[str, Any]
    hash: str

    @staticmethod
    def spec_of(kind: str, config: Any, inputs: Any, toolchain: Any) -> dict[str, Any]:
        return {"kind": kind, "config": config, "inputs": inputs, "toolchain": toolchain}

    @classmethod
    def create(
        cls,
        label: str,
        kind: str,
        config: Mapping[str, Any],
        inputs: Mapping[str, Any],
        toolchain: Mapping[str, Any],
    ) -> Step:
        config, inputs, toolchain = plain(config), plain(inputs), plain(toolchain)  # equal once reloaded
        step_hash = digest("step", cls.spec_of(kind, config, inputs, toolchain))
        return cls(label=label, kind=kind, config=config, inputs=inputs, toolchain=toolchain, hash=step_hash)

    @property
    def upstream(self) -> dict[str, str]:
        """Input name -> hash of the step it comes from (source files are not steps)."""
        return {name: value for name, value in self.inputs.items() if isinstance(value, str)}

    def to_body(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "hash": self.hash,
            **self.spec_of(self.kind, self.config, self.inputs, self.toolchain),
        }

    @classmethod
    def from_body(cls, body: Mapping[str, Any], kinds: Container[str]) -> Step:
        if body["kind"] not in kinds:
            raise ValueError(f"unknown step kind {body['kind']!r}")
        step = cls.create(body["label"], body["kind"], body["config"], body["inputs"], body["toolchain"])
        if step.hash != body["hash"]:
            raise ValueError(f"step {body['label']}: recorded hash does not match its content")
        return step


@attrs.frozen(kw_only=True)
class Plan:
    name: str
    config: Mapping[str, Any]
    steps: tuple[Step, ...]
    targets: tuple[str, ...]
    hash: str

    @staticmethod
    def _body(name: str, config: Any, steps: tuple[Step, ...], targets: tuple[str, ...]) -> dict[str, Any]:
        return {
            "format": PLAN_FORMAT,
            "name": name,
            "config": config,
            "steps": [step.to_body() for step in steps],
            "targets": list(targets),
        }

    @classmethod
    def create(
        cls, name: str, config: Mapping[str, Any], steps: tuple[Step, ...], targets: tuple[str, ...]
    ) -> Plan:
        config = plain(config)  # equal to the plan read back from the store
        plan_hash = digest("plan", cls._body(name, config, steps, targets))
        return cls(name=name, config=config, steps=steps, targets=targets, hash=plan_hash)

    def _shared_body(self) -> dict[str, Any]:
        """The body, sharing this plan's config: only for serializing, never to hand out."""
        return self._body(self.name, self.config, self.steps, self.targets)

    def to_body(self) -> dict[str, Any]:
        """A fresh copy: editing it cannot change this (frozen) plan."""
        return copy.deepcopy(self._shared_body())

    def canonical(self) -> bytes:
        """The plan's canonical bytes, what the store keeps under its hash (no copy of the body
        is made: a null build of a sweep serializes every plan more than once)."""
        return canonical_bytes(self._shared_body())

    def pretty(self) -> bytes:
        """The plan as indented JSON with its hash first, for people (a run record's plan.json)."""
        return json.dumps({"hash": self.hash, **self._shared_body()}, indent=2).encode()

    @classmethod
    def from_body(cls, body: Mapping[str, Any], *, kinds: Container[str]) -> Plan:
        """Rebuild a stored plan, checking every step hash, that each step's kind is in `kinds`
        (the caller passes the registry, `buildtrain.kinds.KINDS`, which sits above this module)
        and the DAG's references."""
        if body.get("format") != PLAN_FORMAT:
            raise ValueError(f"unknown plan format {body.get('format')!r}")
        steps = tuple(Step.from_body(step, kinds) for step in body["steps"])
        plan = cls.create(body["name"], body["config"], steps, tuple(body["targets"]))
        # Names become paths (export folders, temporary folders): an edited plan must not choose them.
        problem = name_problem(plan.name) if isinstance(plan.name, str) else "the name is not a string"
        if problem:
            raise ValueError(f"name: {problem}")
        for step in plan.steps:
            label = step.label if isinstance(step.label, str) else ""
            kind, colon, stage = label.partition(":")
            if kind != step.kind or (colon and name_problem(stage)):
                raise ValueError(
                    f"step label {step.label!r} is not '{step.kind}' or '{step.kind}:NAME' with a safe NAME "
                    "(letters, digits, '.', '_', '-', not starting with '.')"
                )
        seen: set[str] = set()
        for step in plan.steps:
            missing = set(step.upstream.values()) - seen
            if missing:
                raise ValueError(f"step {step.label} depends on a step that does not precede it")
            seen.add(step.hash)
        if not set(plan.targets) <= seen:
            raise ValueError("a target is not a step of the plan")
        return plan

    def step(self, step_hash: str) -> Step:
        for step in self.steps:
            if step.hash == step_hash:
                return step
        raise KeyError(step_hash)

    @property
    def numerics(self) -> NumericsConfig:
        """The plan's numerics, typed (a portable plan records no thread count: 0 stands for it)."""
        return converter.structure({"threads": 0, **self.config["numerics"]}, NumericsConfig)

    def by_label(self, label: str) -> Step:
        for step in self.steps:
            if step.label == label:
                return step
        raise KeyError(label)
