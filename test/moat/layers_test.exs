defmodule Moat.LayersTest do
  # No compile-time or runtime dependency cycle between the library's modules
  # (what `mix xref graph --format cycles` reports); the worker's side is
  # port/tests/layers.rs.
  use ExUnit.Case, async: false

  import ExUnit.CaptureIO

  test "mix xref finds no cycle among the library's modules" do
    output = capture_io(fn -> Mix.Task.rerun("xref", ["graph", "--format", "cycles", "--no-compile"]) end)
    assert output =~ "No cycles found", output
  end
end
