"""Mesh-to-mesh weight sync planning: layouts of sharded trainers and TP/EP generator replicas,
the deterministic planner, and ``python -m transport.plan simulate`` at cluster scale.

Pure Python (numpy): nothing here moves bytes; :mod:`transport.weights` executes plans, and
imports from this package only the names below: the box arithmetic, the layouts and their wire
codec (``encode_*``/``decode_*``, bounded by ``MAX_LAYOUT_BYTES``), the planner, and the FP8
block format (``FP8_*``, ``fp8_*``).
"""

from .._errors import MeshLayoutError as MeshLayoutError
from .._public import rehome
from ._boxes import Box as Box
from ._boxes import Shape as Shape
from ._boxes import box_shape as box_shape
from ._boxes import full_box as full_box
from ._boxes import intersect as intersect
from ._boxes import segments as segments
from ._boxes import volume as volume
from ._codec import MAX_LAYOUT_BYTES as MAX_LAYOUT_BYTES
from ._codec import RankLayout as RankLayout
from ._codec import decode_rank as decode_rank
from ._codec import decode_trainer as decode_trainer
from ._codec import encode_rank as encode_rank
from ._codec import encode_trainer as encode_trainer
from ._fp8 import FP8_BLOCK as FP8_BLOCK
from ._fp8 import FP8_DTYPE as FP8_DTYPE
from ._fp8 import FP8_MAX as FP8_MAX
from ._fp8 import fp8_blocks as fp8_blocks
from ._fp8 import fp8_generator_rank as fp8_generator_rank
from ._fp8 import fp8_scale_name as fp8_scale_name
from ._fp8 import fp8_trainer_layout as fp8_trainer_layout
from ._layouts import ITEMSIZE as ITEMSIZE
from ._layouts import ExplicitSharding as ExplicitSharding
from ._layouts import GeneratorRank as GeneratorRank
from ._layouts import LocalTensor as LocalTensor
from ._layouts import MeshSharding as MeshSharding
from ._layouts import Piece as Piece
from ._layouts import Replica as Replica
from ._layouts import Replicate as Replicate
from ._layouts import Shard as Shard
from ._layouts import TensorSpec as TensorSpec
from ._layouts import TrainerLayout as TrainerLayout
from ._layouts import merge_trainer_layouts as merge_trainer_layouts
from ._layouts import trainer_layout_from_state_dict as trainer_layout_from_state_dict
from ._models import BUILTIN_MODELS as BUILTIN_MODELS
from ._models import ModelConfig as ModelConfig
from ._models import builtin_model as builtin_model
from ._models import checkpoint_tensors as checkpoint_tensors
from ._models import model_config as model_config
from ._models import parameter_count as parameter_count
from ._models import parse_trainer_spec as parse_trainer_spec
from ._models import trainer_layout as trainer_layout
from ._planner import Move as Move
from ._planner import Plan as Plan
from ._planner import Planner as Planner
from ._planner import RankPlan as RankPlan
from ._planner import ReplicaPlan as ReplicaPlan
from ._planner import Topology as Topology
from ._vllm import generator_rank as generator_rank
from ._vllm import generator_replica as generator_replica

__all__ = [
    "BUILTIN_MODELS",
    "FP8_BLOCK",
    "FP8_DTYPE",
    "FP8_MAX",
    "ITEMSIZE",
    "MAX_LAYOUT_BYTES",
    "Box",
    "box_shape",
    "builtin_model",
    "checkpoint_tensors",
    "decode_rank",
    "decode_trainer",
    "encode_rank",
    "encode_trainer",
    "ExplicitSharding",
    "fp8_blocks",
    "fp8_generator_rank",
    "fp8_scale_name",
    "fp8_trainer_layout",
    "full_box",
    "generator_rank",
    "generator_replica",
    "GeneratorRank",
    "intersect",
    "LocalTensor",
    "merge_trainer_layouts",
    "MeshLayoutError",
    "MeshSharding",
    "model_config",
    "ModelConfig",
    "Move",
    "parameter_count",
    "parse_trainer_spec",
    "Piece",
    "Plan",
    "Planner",
    "RankLayout",
    "RankPlan",
    "Replica",
    "ReplicaPlan",
    "Replicate",
    "segments",
    "Shape",
    "Shard",
    "TensorSpec",
    "Topology",
    "trainer_layout",
    "trainer_layout_from_state_dict",
    "TrainerLayout",
    "volume",
]

rehome(globals(), __all__, __name__)
