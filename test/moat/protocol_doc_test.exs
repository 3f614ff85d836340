defmodule Moat.ProtocolDocTest do
  # protocol.md's examples, checked against the Elixir codec: each term
  # encodes to exactly the bytes shown, and the bytes decode to the term.
  use ExUnit.Case, async: true

  @doc_path Path.expand("../../protocol.md", __DIR__)
  @external_resource @doc_path

  examples =
    @doc_path
    |> File.read!()
    |> String.split("## 7. Examples")
    |> List.last()
    |> String.split("### Example: ")
    |> tl()
    |> Enum.map(fn part ->
      [title | _] = String.split(part, "\n", parts: 2)
      [_, term] = Regex.run(~r/```term\n(.*?)```/s, part)
      [_, hex] = Regex.run(~r/```hex\n(.*?)```/s, part)
      {title, String.trim(term), String.replace(hex, ~r/\s/, "")}
    end)

  test "the document has examples" do
    assert length(unquote(Macro.escape(examples))) >= 10
  end

  for {title, term_text, hex} <- examples do
    test "example: #{title}" do
      {term, _} = Code.eval_string(unquote(term_text))
      bytes = Base.decode16!(unquote(hex), case: :lower)
      assert Moat.Protocol.encode_header(term) == bytes
      assert {:ok, ^term, ""} = Moat.Protocol.decode(<<byte_size(bytes)::32, bytes::binary>>)
    end
  end

  test "request frames are header length, header, payload" do
    frame = Moat.Protocol.request(0, 3, :from_binary, [5], [], %{bytes: 4}, ["ab", "cd"])
    binary = IO.iodata_to_binary(frame)
    assert {:ok, {0, 3, :from_binary, [5], [], %{bytes: 4}}, "abcd"} = Moat.Protocol.decode(binary)
  end

  test "undecodable headers are errors, not crashes" do
    assert {:error, _} = Moat.Protocol.decode(<<3::32, 1, 2, 3>>)
    assert {:error, _} = Moat.Protocol.decode(<<9::32, 1>>)
  end
end
