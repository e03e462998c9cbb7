"""What several studies share: `conductor` stages run as a user runs them (stages.py), what a study's episode
files say (episodes.py), where a run's results go and what its summary names (records.py: the commit and the
command), and the warm starts named by commit (pinned.py)."""
