"""HEAT: SimpleX collaborative filtering trained fast on multi-core CPUs (ICS '23).

Public API::

    from slipstream.recsys import (
        load_movielens_100k, synthetic_interactions, user_history,   # data
        SimpleX, SimpleXConfig, train_reference_epoch,                # model + autograd baseline
        HEATTrainer, HEATConfig,                                      # the fast trainer
        evaluate_topk, popularity_scores,                             # full-ranking metrics
    )
"""

from slipstream.recsys.config import HEATConfig, SimpleXConfig
from slipstream.recsys.data import (
    InteractionSplit,
    filter_interactions,
    load_atomic_interactions,
    load_movielens_100k,
    movielens_100k_path,
    split_per_user,
    synthetic_interactions,
    user_history,
)
from slipstream.recsys.heat import HEATTrainer, numba_available
from slipstream.recsys.metrics import evaluate_topk, popularity_scores
from slipstream.recsys.model import SimpleX, train_reference_epoch

__all__ = [
    "HEATConfig",
    "HEATTrainer",
    "InteractionSplit",
    "SimpleX",
    "SimpleXConfig",
    "evaluate_topk",
    "filter_interactions",
    "load_atomic_interactions",
    "load_movielens_100k",
    "movielens_100k_path",
    "numba_available",
    "popularity_scores",
    "split_per_user",
    "synthetic_interactions",
    "train_reference_epoch",
    "user_history",
]
