defmodule Moat.Application do
  @moduledoc false
  use Application

  @impl true
  def start(_type, _args) do
    Moat.Compiler.Cache.init()
    children = if Moat.Config.get(:start_worker), do: [{Moat.Worker, name: Moat.Worker}], else: []

    Supervisor.start_link(children,
      strategy: :one_for_one,
      name: Moat.Supervisor,
      max_restarts: Moat.Config.get(:max_restarts),
      max_seconds: Moat.Config.get(:max_seconds)
    )
  end
end
