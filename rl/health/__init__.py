"""A step's health: guards on its record (collapse, KL limits) and the KL playbook's signals."""
