defmodule Moat.Reliability.SecurityTest do
  # A worker launched the real way (an Erlang port): after real work it holds
  # only the descriptors the port gave it, no socket, and no child but its
  # input holder, which holds only the request pipe. (port/tests/security.rs
  # shows the rest: no op outside the table runs, no tensor bytes in the log.)
  use ExUnit.Case, async: false
  import Moat.Case

  alias Moat.Reliability

  test "the worker holds only its port's descriptors, no sockets, and no other child" do
    worker = start_worker(:security, log_level: :error)
    a = Nx.tensor(for(i <- 1..64, do: for(j <- 1..64, do: i * j * 1.0)), backend: {Moat.Backend, worker: worker})
    assert a |> Nx.dot(a) |> Nx.sum() |> Nx.to_number() > 0

    os_pid = os_pid(worker)
    # On a GPU the CUDA driver opens its own (its devices, eventfds, pipes,
    # a socket) after the port's five; the rest holds as on the CPU.
    gpu? = Moat.Worker.info(worker).device == :gpu

    driver? = fn {fd, t} ->
      gpu? and fd > 4 and String.starts_with?(t, ["/dev/nvidia", "anon_inode:", "pipe:", "socket:"])
    end

    # The worker's own: the session's spin may keep /proc/loadavg open,
    # read-only (port/src/spin.rs); the reader waits on a timer
    # (port/src/input.rs).
    own? = fn {_, t} -> t in ["/proc/loadavg", "anon_inode:[timerfd]"] end
    fds = os_pid |> Reliability.open_fds() |> Enum.reject(&(driver?.(&1) or own?.(&1)))
    assert Enum.map(fds, &elem(&1, 0)) == [0, 1, 2, 3, 4], "descriptors: #{inspect(fds)}"
    assert {3, "pipe:" <> _} = List.keyfind(fds, 3, 0)
    assert {4, "pipe:" <> _} = List.keyfind(fds, 4, 0)
    refute Enum.any?(fds, fn {_, target} -> String.starts_with?(target, "socket:") end), inspect(fds)

    [holder] =
      Path.wildcard("/proc/#{os_pid}/task/*/children")
      |> Enum.flat_map(&(&1 |> File.read!() |> String.split()))

    assert File.read!("/proc/#{holder}/comm") == "moat_port-hold\n"
    assert Reliability.open_fds(holder) == [List.keyfind(fds, 3, 0)]
    assert Path.wildcard("/proc/#{holder}/task/*/children") |> Enum.all?(&(File.read!(&1) == ""))

    Reliability.record(
      :security,
      "descriptors of a port-launched worker after real work",
      1,
      1,
      0,
      "fds 0-4 only (3, 4: the port's pipes); no socket; one child, the input holder, holding only fd 3"
    )
  end
end
