"""A policy for stage unit tests: plain HTTP with a body schema, SQL, and MCP tools."""

from __future__ import annotations

import pytest

from gateway.policy.model import Policy
from gateway.testing import policy_from_text

POLICY = """
version: 1
agents: {"*": [ops, analyst, support]}
upstreams:
  svc: {url: "http://127.0.0.1:9", credentials: {type: bearer, secret: "env:SVC_TOKEN"}}
  db: {url: "http://127.0.0.1:9"}
  tools: {url: "http://127.0.0.1:9", kind: mcp, mcp: {batches: true}}
roles:
  ops:
    rules:
      - id: restart
        upstream: svc
        allow: POST /restart
        headers: {X-Env: {enum: [prod, test]}}
        body:
          schema:
            type: object
            required: [service]
            additionalProperties: false
            properties: {service: {enum: [web, worker]}}
        rate: 2/hour
      - id: status
        upstream: svc
        allow: GET /status
        query: {verbose: {enum: ["0", "1"]}}
  analyst:
    rules:
      - id: query
        upstream: db
        allow: POST /query
        sql:
          {field: sql, dialect: sqlite, tables: [orders],
           schema: {orders: [id, status]}, max_limit: 10, add_limit: true}
  support:
    rate: 100/hour
    rules:
      - id: get-order
        upstream: tools
        allow: POST /mcp
        tool: get_order
        arguments:
          type: object
          required: [order_id]
          additionalProperties: false
          properties: {order_id: {type: integer, minimum: 1}}
        rate: 2/hour
      - id: run-sql
        upstream: tools
        allow: POST /mcp
        tool: run_sql
        sql:
          {argument: sql, dialect: sqlite, tables: [orders],
           schema: {orders: [id, status]}, max_limit: 5, add_limit: true}
      - id: held
        upstream: tools
        allow: POST /mcp
        tool: refund
        approval: required
"""


@pytest.fixture(scope="session")
def policy() -> Policy:
    return policy_from_text(POLICY)
