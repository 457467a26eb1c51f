"""The pointing probe's labels and hit test (benchmarks/probes/pointing_data.py), worked by hand."""

from benchmarks.probes import pointing_data as probe


def test_target_reply_is_the_box_centre_on_the_tens3_grid():
  # screen 210 x 160 px; box x 40..80, y 105..147 -> centre (60, 126) px = (375, 600) per mille -> (380, 600)
  assert probe.target_reply((40, 105, 40, 42), (210, 160)) == \
      "Thought: \nAction: click(start_box='(380,600)')"


def test_hit_uses_screen_pixels_and_rejects_missing_boxes():
  hw, click = (210, 160), "Thought: \nAction: click(start_box='({})')"
  assert probe.hit(click.format("380,600"), (40, 105, 40, 42), hw)      # (60.8, 126) px
  assert not probe.hit(click.format("560,600"), (40, 105, 40, 42), hw)  # (89.6, 126) px: right of the box
  assert not probe.hit(click.format("380,600"), (-1, -1, -1, -1), hw)   # no such button (click-test's "other")
