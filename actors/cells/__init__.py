"""The cells wing: cells that serve rollouts or train, the weight broker, and the KV migrator.

`cell.py` owns all of a cell's state and sequences every switch; `rollout_role.py` and `train_role.py` host the
engine and the trainer and take explicit inputs; `weight_broker.py` versions the core's weights and `weight_pull.py`
is a cell's side of pulling them through Mooncake; `kv_migrator.py` moves live sessions' KV between engines.
"""

from gyre.runtime.exports import lazy_exports

__all__ = ["Cell", "CellConfig", "KVMigrator", "KVMigratorConfig", "WeightBroker", "WeightBrokerConfig"]

__getattr__, __dir__ = lazy_exports(__name__, {
    "Cell": "cell",
    "CellConfig": "cell",
    "KVMigrator": "kv_migrator",
    "KVMigratorConfig": "kv_migrator",
    "WeightBroker": "weight_broker",
    "WeightBrokerConfig": "weight_broker",
})
