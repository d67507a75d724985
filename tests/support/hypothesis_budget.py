"""How many Hypothesis examples a property test runs: its own number, or fewer under mutation testing.

``scripts/mutate.py`` sets ``MOONEP_EP_TEST_MAX_EXAMPLES`` for modules whose property tests every mutant
reaches (the planner's, the store's closed form): each mutant reruns them, so 200 examples each would not fit
a module's run. ``make test`` leaves it unset and runs every example.
"""

from __future__ import annotations

import os


def max_examples(default: int) -> int:
    """``default``, capped by ``MOONEP_EP_TEST_MAX_EXAMPLES`` when that is set."""
    cap = os.environ.get("MOONEP_EP_TEST_MAX_EXAMPLES")
    return min(default, int(cap)) if cap else default
