"""What the reaper does when nobody reports, one module per duty."""
