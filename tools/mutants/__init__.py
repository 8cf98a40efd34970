"""The bug zoo (DESIGN §9): realistic engine defects, each applied to a temporary copy and killed by the CPU tier."""
