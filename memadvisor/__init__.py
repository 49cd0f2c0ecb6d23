"""memadvisor: measure a PyTorch training step, find the fastest configuration that fits a budget.

tuned = memadvisor.optimize(model, sample_batch, budget_gb=8)
"""

from memadvisor.api import optimize, plan
from memadvisor.apply import apply_plan
from memadvisor.config import PlanConfig
from memadvisor.errors import (
    BadInputError,
    InfeasibleBudgetError,
    MemadvisorError,
    PlanningError,
    SimulatedOutOfMemoryError,
)
from memadvisor.estimate import Candidate, Estimate, estimate
from memadvisor.monitor import Monitor, trace
from memadvisor.planner import Plan
from memadvisor.profiler import Profile, profile
from memadvisor.strategy import Advice, Strategy, load_strategies
from memadvisor.workload import Workload, train_step

__version__ = "0.1.0"

__all__ = [
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
    "Strategy",
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
