"""The stalwart API: the TrainingJob resource (``stalwart.dev/v1alpha1``) and the JSON records kept in etcd.

These pydantic v2 models are the one source of truth for the CRD (:mod:`stalwart.api.crd`), for
``stalwart validate`` (:mod:`stalwart.api.validation`) and for every record stalwart writes to etcd.
"""

from stalwart.api.base import MAX_RECORD_BYTES, ApiModel, Rule, RuleViolation
from stalwart.api.failure_rules import ExitCodeMatch, ExitCodeOperator, FailureAction, FailureReason, FailureRule
from stalwart.api.job_record import JobRecord
from stalwart.api.naming import (
    LABEL_INDEX,
    LABEL_JOB_NAME,
    LABEL_ROLE,
    MAX_JOB_NAME_LENGTH,
    ROLE_SPARE,
    ROLE_WORKER,
    check_job_name,
    pod_labels,
    secret_name,
    selector,
    service_name,
    spare_pod_name,
    worker_pod_name,
)
from stalwart.api.spec import (
    CleanPodPolicy,
    Container,
    InProcessRestart,
    PodSpec,
    PodTemplate,
    RendezvousSpec,
    RestartPolicy,
    RunPolicy,
    SecretReference,
    SuccessPolicy,
    TrainingJobSpec,
)
from stalwart.api.status import (
    Condition,
    ConditionStatus,
    ConditionType,
    FailureRecord,
    Phase,
    Progress,
    RestartCounts,
    TrainingJobStatus,
)
from stalwart.api.trainingjob import (
    API_VERSION,
    GROUP,
    KIND,
    PLURAL,
    SHORT_NAMES,
    SINGULAR,
    VERSION,
    ObjectMeta,
    TrainingJob,
)

__all__ = [
    "API_VERSION", "GROUP", "KIND", "LABEL_INDEX", "LABEL_JOB_NAME", "LABEL_ROLE", "MAX_JOB_NAME_LENGTH",
    "MAX_RECORD_BYTES", "PLURAL", "ROLE_SPARE", "ROLE_WORKER", "SHORT_NAMES", "SINGULAR", "VERSION",
    "ApiModel", "CleanPodPolicy", "Condition", "ConditionStatus", "ConditionType", "Container",
    "ExitCodeMatch", "ExitCodeOperator", "FailureAction", "FailureReason", "FailureRecord", "FailureRule",
    "InProcessRestart", "JobRecord", "ObjectMeta", "Phase", "PodSpec", "PodTemplate", "Progress",
    "RendezvousSpec", "RestartCounts", "RestartPolicy", "Rule", "RuleViolation", "RunPolicy",
    "SecretReference", "SuccessPolicy", "TrainingJob", "TrainingJobSpec", "TrainingJobStatus",
    "check_job_name", "pod_labels", "secret_name", "selector", "service_name", "spare_pod_name",
    "worker_pod_name",
]
