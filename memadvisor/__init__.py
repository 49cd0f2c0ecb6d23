"""memadvisor: measure a PyTorch training step, find the fastest configuration that fits a budget.

tuned = memadvisor.optimize(model, sample_batch, budget_gb=8)
"""

from memadvisor._version import __version__
from memadvisor.api import optimize, plan, profile
from memadvisor.apply import apply_plan
from memadvisor.errors import (
    BadInputError,
    InfeasibleBudgetError,
    MemadvisorError,
    PlanningError,
    SimulatedOutOfMemoryError,
)
from memadvisor.estimate import estimate
from memadvisor.losses import TokenCrossEntropy
from memadvisor.monitor import Monitor, trace
from memadvisor.report import lend_views as _  # noqa: F401 - lends Plan its report views
from memadvisor.schema.advice import Advice
from memadvisor.schema.candidate import Candidate, Estimate
from memadvisor.schema.config import PlanConfig
from memadvisor.schema.plan import Plan
from memadvisor.schema.profile import Profile
from memadvisor.step import Step
from memadvisor.strategy import Strategy, load_strategies
from memadvisor.workload import Workload, train_step

__all__ = [
    "__version__",
    "Advice",
    "BadInputError",
    "Candidate",
    "Estimate",
    "InfeasibleBudgetError",
    "MemadvisorError",
    "Monitor",
    "Plan",
    "PlanConfig",
    "PlanningError",
    "Profile",
    "SimulatedOutOfMemoryError",
    "Step",
    "Strategy",
    "TokenCrossEntropy",
    "Workload",
    "apply_plan",
    "estimate",
    "load_strategies",
    "optimize",
    "plan",
    "profile",
    "trace",
    "train_step",
]
