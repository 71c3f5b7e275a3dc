"""Fixtures of the reliability suite.

``two_trust_groups``: API keys in two trust groups, for every test that checks one group never sees,
uses or changes what another holds (adapters, cached and transferred K/V, event streams). Group ``a``
has two keys (``a_key``, ``a_other_key``: one group, two keys), group ``b`` one (``b_key``).
``create_app(engine, api_keys=groups.api_keys)`` serves them in process; ``groups.env`` starts a
``stagedserve serve`` process with them (``STAGEDSERVE_API_KEY``, ``'KEY group=NAME'`` entries).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class TwoTrustGroups:
    a_key: str = "group-a-first-key"
    a_other_key: str = "group-a-second-key"
    b_key: str = "group-b-only-key"
    a: str = "team-a"
    b: str = "team-b"

    @property
    def api_keys(self) -> dict[str, str]:
        """``{key: trust group}``, as ``create_app(api_keys=...)`` takes it."""
        return {self.a_key: self.a, self.a_other_key: self.a, self.b_key: self.b}

    @property
    def env(self) -> dict[str, str]:
        """The same keys for a ``stagedserve serve`` process."""
        return {"STAGEDSERVE_API_KEY": ",".join(f"{key} group={group}" for key, group in self.api_keys.items())}

    def headers(self, key: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="session")
def two_trust_groups() -> TwoTrustGroups:
    return TwoTrustGroups()
