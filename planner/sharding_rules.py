"""The sharding rules of every primitive, filled: `LEADER_RULES` and `FOLLOW_RULES` as
`leader_rules` and `follow_rules` register them into `strategy`'s tables. The phases that read
the rules import them from here, so the tables are filled by an explicit import, not as a side
effect of whichever module happened to import a rule module first."""

from autopar.planner import follow_rules, leader_rules
from autopar.planner.strategy import FOLLOW_RULES, LEADER_RULES

__all__ = ["FOLLOW_RULES", "LEADER_RULES", "follow_rules", "leader_rules"]
