"""Codistillation pieces without processes: rank layout, config checks, distillation loss, weight copies."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from pretrain.checkpointing.checkpoint import record_tied_parameters
from pretrain.codistill.config import CodistillConfigError, CodistillSection, check_codistill
from pretrain.codistill.groups import GroupLayout
from pretrain.codistill.teacher import distillation_loss, flat_weights, load_flat, make_teacher, soft_targets
from pretrain.model.bert import bert_config, build_model


@pytest.mark.parametrize(("world", "groups", "rank", "group", "group_rank", "exchange"), [
    (2, 2, 1, 1, 0, [0, 1]),
    (4, 2, 3, 1, 1, [1, 3]),
    (6, 3, 4, 2, 0, [0, 2, 4]),
])
def test_group_layout_is_contiguous_blocks(world: int, groups: int, rank: int, group: int, group_rank: int,
                                           exchange: list[int]) -> None:
    layout = GroupLayout(world, groups, rank)
    assert (layout.group, layout.group_rank) == (group, group_rank)
    assert rank in layout.ranks_of_group(group)
    assert layout.exchange_ranks(group_rank) == exchange
    assert group not in layout.other_groups and len(layout.other_groups) == groups - 1


def test_group_layout_refuses_unequal_blocks() -> None:
    with pytest.raises(ValueError, match="codistill.groups: 2 groups do not split a world of 3"):
        GroupLayout(3, 2, 0)


@pytest.mark.parametrize(("change", "key"), [
    ({"groups": 1}, "codistill.groups"),
    ({"alpha": -0.5}, "codistill.alpha"),
    ({"burn_in_steps": -1}, "codistill.burn_in_steps"),
    ({"refresh_every": 0}, "codistill.refresh_every"),
    ({"temperature": 0.0}, "codistill.temperature"),
    ({"loss": "js"}, "codistill.loss"),
    ({"targets": ["nsp"]}, "codistill.targets"),
    ({"targets": ["mlm", "sop"]}, "codistill.targets"),
    ({"exchange": "nccl"}, "codistill.exchange"),
    ({"group": 2, "exchange": "filesystem"}, "codistill.group"),
    ({"group": 0}, "codistill.exchange"),  # separate jobs meet only through files
    ({"exchange_timeout_s": -1.0}, "codistill.exchange_timeout_s"),
])
def test_config_errors_name_the_key(change: dict, key: str) -> None:
    section = CodistillSection(enabled=True, **change)
    with pytest.raises(CodistillConfigError, match=key.replace(".", r"\.")):
        check_codistill(section)


def test_config_checks_world_split_and_ignores_disabled_section() -> None:
    check_codistill(CodistillSection(enabled=False, groups=0))
    check_codistill(CodistillSection(enabled=True, groups=2), world_size=4)
    with pytest.raises(CodistillConfigError, match="world of 3"):
        check_codistill(CodistillSection(enabled=True, groups=2), world_size=3)
    # a separate job is one whole group: any world size
    check_codistill(CodistillSection(enabled=True, groups=2, group=1, exchange="filesystem"), world_size=3)


def test_separate_job_layout_is_the_whole_world_as_one_group() -> None:
    layout = GroupLayout(3, 4, 2, job_group=1)
    assert (layout.group, layout.group_rank, layout.group_size, layout.first_rank) == (1, 2, 3, 0)
    assert layout.other_groups == [0, 2, 3] and layout.groups_in_job == [1]
    together = GroupLayout(4, 2, 3)
    assert together.first_rank == 2 and together.groups_in_job == [0, 1] and not together.separate_jobs
    with pytest.raises(ValueError, match="codistill.group: 4 is not one of 4 groups"):
        GroupLayout(3, 4, 0, job_group=4)


def test_codistillation_owns_the_data_parts(tmp_path) -> None:  # noqa: ANN001
    from pretrain.config.load import load_config
    from pretrain.errors import ConfigError
    from tests.support.pretrain_fixtures import tiny_run_config

    run_json = tiny_run_config(tmp_path / "run.json", tmp_path / "shards", tmp_path / "run")
    assert load_config(run_json, ["--codistill.enabled=true"]).plugins["codistill"].disjoint_data is True
    with pytest.raises(ConfigError, match="data.num_parts: codistillation deals the data"):
        load_config(run_json, ["--codistill.enabled=true", "--data.num_parts=2"])
    shared = load_config(run_json, ["--codistill.enabled=true", "--codistill.disjoint_data=false", "--data.num_parts=2"])
    assert shared.data.num_parts == 2


def test_kl_is_zero_at_agreement_and_soft_ce_has_the_same_gradient() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 11)
    same = distillation_loss(logits, F.softmax(logits / 2.0, -1), 2.0, "kl")
    assert same.abs() < 1e-6
    teacher = torch.randn(6, 11)
    targets = soft_targets([teacher], 2.0)
    grads = []
    for kind in ("kl", "soft_ce"):
        student = logits.clone().requires_grad_(True)
        distillation_loss(student, targets, 2.0, kind).backward()
        grads.append(student.grad)
    assert torch.allclose(grads[0], grads[1], atol=1e-7)
    assert grads[0].abs().sum() > 0


def test_loss_matches_its_definition_with_averaged_teachers_and_t_squared() -> None:
    torch.manual_seed(1)
    student, t1, t2 = torch.randn(3, 5, 7)
    temperature = 3.0
    targets = soft_targets([t1, t2], temperature)
    expected_targets = (F.softmax(t1 / temperature, -1) + F.softmax(t2 / temperature, -1)) / 2
    assert torch.allclose(targets, expected_targets)
    kl = F.kl_div(F.log_softmax(student / temperature, -1), expected_targets, reduction="batchmean")
    assert torch.allclose(distillation_loss(student, targets, temperature, "kl"), kl * temperature**2, atol=1e-6)
    assert distillation_loss(student[:0], targets[:0], temperature, "kl").item() == 0.0  # no masked positions


@pytest.mark.parametrize("kind", ["kl", "soft_ce"])
def test_distillation_over_labelled_slots_equals_the_loss_on_selected_rows(kind: str) -> None:
    """The MLM head returns every slot; distilling with `valid` = the labelled mask has the value and gradient
    of the previous loss over the labelled rows alone, and empty slots (even non-finite ones) add nothing."""
    config = bert_config("tiny", 48, 64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(4)
    student, teacher = build_model(config), build_model(config).eval()
    ids = torch.randint(5, 48, (3, 20))
    batch = {"input_ids": ids, "token_type_ids": torch.zeros_like(ids), "attention_mask": torch.ones_like(ids),
             "masked_positions": torch.tensor([[1, 4, 7, 9], [2, 3, 0, 0], [5, 0, 0, 0]]),
             "masked_labels": torch.tensor([[9, 10, 11, 12], [13, 14, -100, -100], [15, -100, -100, -100]]),
             "next_sentence_label": torch.tensor([0, 1, 0])}
    out = student(**batch)
    with torch.no_grad():
        targets = soft_targets([teacher(**batch).mlm_logits], 2.0)
    mask = out.mlm_mask
    assert out.mlm_logits.shape[0] == 12 and int(mask.sum()) == 7
    logits = out.mlm_logits.detach().requires_grad_(True)
    selected = logits.detach()[mask].requires_grad_(True)
    masked = distillation_loss(logits, targets, 2.0, kind, valid=mask)
    previous = distillation_loss(selected, targets[mask], 2.0, kind)  # what the boolean-select head gave
    torch.testing.assert_close(masked, previous, rtol=1e-6, atol=1e-7)
    masked.backward()
    previous.backward()
    torch.testing.assert_close(logits.grad[mask], selected.grad, rtol=1e-6, atol=1e-9)
    assert torch.all(logits.grad[~mask] == 0)
    poisoned = logits.detach().clone()
    poisoned[~mask] = float("nan")
    torch.testing.assert_close(distillation_loss(poisoned, targets, 2.0, kind, valid=mask), previous.detach())
    none = torch.zeros_like(mask)
    assert distillation_loss(logits, targets, 2.0, kind, valid=none).item() == 0.0  # no labelled slot


def test_teacher_copy_is_frozen_and_receives_weights_exactly() -> None:
    config = bert_config("tiny", 48, 64)
    torch.manual_seed(3)
    student = build_model(config)
    engine = types.SimpleNamespace(module=student)  # ZeRO stage 0 view: the module holds whole weights
    teacher = make_teacher(config, torch.device("cpu"), torch.float32)
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
    load_flat(teacher, flat_weights(engine))
    for (name, mine), theirs in zip(student.state_dict().items(), teacher.state_dict().values(), strict=True):
        assert torch.equal(mine, theirs), name
    with pytest.raises(ValueError, match="expected"):
        load_flat(teacher, torch.zeros(3))


def test_tied_parameter_map_matches_deepspeed_convention(tmp_path) -> None:  # noqa: ANN001
    model = build_model(bert_config("tiny", 48, 64))
    path = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": {}, "shared_params": {}}, path)
    record_tied_parameters(model, tmp_path)
    shared = torch.load(path, weights_only=False)["shared_params"]
    assert shared == {"cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
                      "cls.predictions.decoder.bias": "cls.predictions.bias"}


def test_run_config_has_a_typed_codistill_section() -> None:
    from pretrain.config.load import from_dict
    from pretrain.errors import ConfigError

    config = from_dict({"codistill": {"enabled": True, "groups": 3, "alpha": 1, "targets": ["mlm", "nsp"]}})
    section = config.plugins["codistill"]
    assert section.groups == 3 and section.alpha == 1.0 and section.exchange == "collective"
    with pytest.raises(ConfigError, match=r"codistill\.alpah: unknown key"):
        from_dict({"codistill": {"alpah": 1.0}})
    with pytest.raises(ConfigError, match=r"codistill\.refresh_every: expected int"):
        from_dict({"codistill": {"refresh_every": "often"}})
