"""AgentDojo's tasks and attacks through capgate: ``python -m eval.agentdojo`` (``make eval``)."""
