"""The outcome of a write that answered 202."""

from __future__ import annotations

from fastapi import APIRouter

from services.api.deps import PrincipalDep, ReadSessionDep, require, scope
from services.api.errors import not_found
from services.api.routing import CheckedRoute
from services.api.schemas import WriteStatus
from shared import write_records
from shared.ids import is_valid_write_id

router = APIRouter(prefix="/memory-writes", tags=["memory entries"], route_class=CheckedRoute)


# Who got a 202 polls here, and the outcome only names an entry a reader may fetch anyway:
# either action will do.
@router.get(
    "/{write_id}",
    summary="The stored outcome of a write: pending, applied or failed",
    dependencies=[require("memories:CreateMemoryEntry", "memories:GetMemoryEntry")],
)
async def get_write(write_id: str, session: ReadSessionDep, principal: PrincipalDep) -> WriteStatus:
    outcome = None
    if is_valid_write_id(write_id):
        outcome = await write_records.get_write_outcome_for_project(session, scope(principal), write_id)
    if outcome is None:
        raise not_found("write", write_id)
    return WriteStatus.of(outcome)
