"""Deterministic fixture data shared by the mock upstreams.

The SQLite mock (`mocks.servers.db_app`) and the MCP mock (`mocks.mcp_server`) serve the same
customers and orders, so a test can cross-check one against the other. Everything here is a pure
function of the index: no randomness, no clock.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from typing import Any, Final

CUSTOMER_COUNT: Final = 20
ORDER_COUNT: Final = 100

ORDER_STATUSES: Final = ("pending", "paid", "shipped", "delivered", "refunded")

_FIRST_NAMES: Final = (
    "Ada", "Grace", "Alan", "Edsger", "Barbara", "Donald", "Frances", "Ken", "Margaret", "Niklaus",
)  # fmt: skip
_LAST_NAMES: Final = ("Lovelace", "Hopper", "Turing", "Dijkstra", "Liskov", "Knuth", "Allen")
_COUNTRIES: Final = ("US", "GB", "DE", "FR", "NL", "JP", "BR")
_FIRST_ORDER_AT: Final = datetime(2024, 1, 1, 9, 0, 0)


@dataclass(frozen=True, slots=True)
class Customer:
    id: int
    name: str
    email: str
    ssn: str
    country: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Order:
    id: int
    customer_id: int
    total_cents: int
    status: str
    created_at: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _customer(i: int) -> Customer:
    first = _FIRST_NAMES[i % len(_FIRST_NAMES)]
    last = _LAST_NAMES[(i * 3) % len(_LAST_NAMES)]
    customer_id = i + 1
    return Customer(
        id=customer_id,
        name=f"{first} {last}",
        email=f"{first.lower()}.{last.lower()}{customer_id}@example.com",
        # 900-999 is never issued as an SSN area number: clearly fake, still SSN-shaped.
        ssn=f"9{customer_id:02d}-{(customer_id * 7) % 100:02d}-{(customer_id * 1237) % 10000:04d}",
        country=_COUNTRIES[i % len(_COUNTRIES)],
    )


def _order(i: int) -> Order:
    order_id = i + 1
    return Order(
        id=order_id,
        customer_id=(i * 7) % CUSTOMER_COUNT + 1,
        total_cents=1000 + (order_id * 7919) % 49000,
        status=ORDER_STATUSES[i % len(ORDER_STATUSES)],
        created_at=(_FIRST_ORDER_AT + timedelta(days=i * 3, minutes=i * 37)).isoformat() + "Z",
    )


CUSTOMERS: Final[tuple[Customer, ...]] = tuple(_customer(i) for i in range(CUSTOMER_COUNT))
ORDERS: Final[tuple[Order, ...]] = tuple(_order(i) for i in range(ORDER_COUNT))


def orders_for_customer(customer_id: int, limit: int | None = None) -> list[Order]:
    """The orders of one customer, by ascending id, at most `limit` of them."""
    found = [order for order in ORDERS if order.customer_id == customer_id]
    return found if limit is None else found[: max(limit, 0)]


def order_by_id(order_id: int) -> Order | None:
    if 1 <= order_id <= len(ORDERS):
        return ORDERS[order_id - 1]
    return None
